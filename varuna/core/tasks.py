"""The vocabulary of schedules: a task (F, R or B of one micro-batch) and checks on task lists.

Pure Python (no torch). A *task* is F (forward), R (recompute) or B (backward) of one
micro-batch on one stage; micro-batch indices are 0-based and local to one replica pipeline.

Example::

    >>> format_tasks(parse_tasks("F0 F1 B0 B1"))
    'F0 F1 B0 B1'
    >>> peak_stashed(parse_tasks("F0 F1 R0 B0 R1 B1"))
    2
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "FORWARD",
    "RECOMPUTE",
    "BACKWARD",
    "WEIGHT",
    "Task",
    "format_tasks",
    "parse_tasks",
    "task_positions",
    "validate_stage_tasks",
    "peak_stashed",
    "recomputed",
]

FORWARD = "F"
RECOMPUTE = "R"
BACKWARD = "B"
#: The weight-gradient half of a split backward (zero-bubble kinds, ``varuna/core/zero_bubble.py``):
#: B then computes only the input gradient and W the parameter gradients, later.
WEIGHT = "W"


@dataclass(frozen=True, slots=True, order=True)
class Task:
    """One unit of work of a stage: ``op`` in {"F", "R", "B", "W"} on ``microbatch`` (0-based).

    >>> Task("F", 3)
    Task(op='F', microbatch=3)
    >>> str(Task("B", 0))
    'B0'
    """

    op: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Task:
        """Parse the string form (``"F3"``) back into a Task."""
        text = text.strip()
        if len(text) < 2 or text[0] not in (FORWARD, RECOMPUTE, BACKWARD, WEIGHT) or not text[1:].isdigit():
            raise ValueError(f"cannot parse task {text!r}: expected F<i>, R<i>, B<i> or W<i> with i >= 0")
        return cls(text[0], int(text[1:]))


def format_tasks(tasks: Iterable[Task]) -> str:
    """Space-separated string form of a task list (``"F0 F1 R0 B0"``)."""
    return " ".join(str(t) for t in tasks)


def parse_tasks(text: str) -> list[Task]:
    """Inverse of :func:`format_tasks`."""
    return [Task.parse(tok) for tok in text.split()]


def recomputed(tasks: Sequence[Task]) -> frozenset[int]:
    """Micro-batches that ``tasks`` recompute (whose forward runs without a graph).

    >>> sorted(recomputed(parse_tasks("F0 F1 B1 R0 B0")))
    [0]
    """
    return frozenset(t.microbatch for t in tasks if t.op == RECOMPUTE)


def task_positions(tasks: Sequence[Task], num_microbatches: int) -> dict[Task, int]:
    """Each task's position in ``tasks``; ValueError (one line) for a micro-batch outside
    0..num_microbatches-1 or a task listed twice. The common part of the list checks.

    >>> task_positions(parse_tasks("F0 B0"), 1)[Task.parse("B0")]
    1
    """
    seen: dict[Task, int] = {}
    for pos, t in enumerate(tasks):
        if not 0 <= t.microbatch < num_microbatches:
            raise ValueError(f"task {t} at position {pos} is outside 0..{num_microbatches - 1}")
        if t in seen:
            raise ValueError(f"task {t} appears twice (positions {seen[t]} and {pos})")
        seen[t] = pos
    return seen


def validate_stage_tasks(
    tasks: Sequence[Task], num_microbatches: int, *, forbid_recompute: bool = False
) -> None:
    """Raise ValueError unless ``tasks`` is a well-formed list for one stage.

    Every micro-batch has exactly one F and one B, F before B, at most one R placed between them,
    and (rule 2) an R is immediately followed by its own B. ``forbid_recompute``: no R at all
    (varuna's last stage).
    """
    seen = task_positions(tasks, num_microbatches)
    for i in range(num_microbatches):
        f, b, r = Task(FORWARD, i), Task(BACKWARD, i), Task(RECOMPUTE, i)
        if f not in seen or b not in seen:
            raise ValueError(f"micro-batch {i} lacks its F or B task")
        if seen[f] > seen[b]:
            raise ValueError(f"B{i} comes before F{i}")
        if r in seen:
            if forbid_recompute:
                raise ValueError(f"this stage must not recompute (found R{i})")
            if not seen[f] < seen[r] < seen[b]:
                raise ValueError(f"R{i} must lie between F{i} and B{i}")
            if seen[b] != seen[r] + 1:
                raise ValueError(f"R{i} must be followed directly by B{i} (rule 2)")


def peak_stashed(tasks: Sequence[Task]) -> int:
    """Most micro-batches whose forward is done and backward not yet, along ``tasks`` (a split
    backward is done at its W: W needs the stage's input and activations).

    >>> peak_stashed(parse_tasks("F0 F1 B0 W0 B1 W1")), peak_stashed(parse_tasks("F0 B0 F1 B1 W0 W1"))
    (2, 2)
    """
    end = WEIGHT if any(t.op == WEIGHT for t in tasks) else BACKWARD
    live = peak = 0
    for t in tasks:
        if t.op == FORWARD:
            live += 1
            peak = max(peak, live)
        elif t.op == end:
            live -= 1
    return peak
