"""Whether a worker left the job before building its Engine while the others wait for it (Note
[Lifecycle lines] in :mod:`varuna.core.lifecycle`): the supervisor feeds :class:`EarlyExits` the
phases each rank announced and the exit codes it saw, and asks it for a culprit.

A rank is a culprit when it exited 0 without ever announcing ``built`` while another rank still
runs and waits (its last phase ``rendezvous`` or ``built``: it is in the rendezvous, or in a
collective of the Engine's construction, for the culprit that never comes). The decision is
asked again on every poll, so it does not matter which comes first: the culprit's exit, or the
waiting rank's ``rendezvous`` line. Nothing is decided while no rank announced a phase (a script
that uses no Engine anywhere, or a launch without lifecycle lines): such a job is as before.

A rank exiting 0 after ``built`` (then ``closed``) finished normally; if the others still need it
(a script returning mid-run on one rank), their peer watch names it (Note [Blame] in
:mod:`varuna.launch.supervisor`). A non-zero exit is reported at once by the supervisor already.

Example::

    >>> ee = EarlyExits()
    >>> ee.saw(0, "rendezvous"); ee.exited(1, 0)
    >>> ee.culprit(running=[0])
    1
    >>> print(early_exit_line("rank 1 stage 1 replica 0", 0, waiting=[0]))  # doctest: +ELLIPSIS
    rank 1 stage 1 replica 0 exited with code 0 before building its Engine, while rank 0 waits ...
"""

from __future__ import annotations

from collections.abc import Iterable

from varuna.core.lifecycle import BUILT, PHASES, RENDEZVOUS

__all__ = ["EarlyExits", "early_exit_line"]

#: The phases in which a running rank waits for every other rank.
_WAITING = (RENDEZVOUS, BUILT)


class EarlyExits:
    """Per rank: the last lifecycle phase it announced, whether it built an Engine, and whether it
    exited 0 without one. Fed from the supervisor's reader threads (:meth:`saw`) and its poll loop
    (:meth:`exited`, :meth:`culprit`); each update is one dict or set operation (atomic under the
    GIL), so no lock is needed.

    Example::

        >>> ee = EarlyExits()
        >>> ee.saw(0, "rendezvous"); ee.saw(1, "rendezvous"); ee.saw(1, "built"); ee.exited(1, 0)
        >>> ee.culprit(running=[0]) is None  # rank 1 built its Engine: a normal exit
        True
    """

    def __init__(self) -> None:
        self._phase: dict[int, str] = {}  # rank -> the last phase it announced
        self._built: set[int] = set()  # ranks that built an Engine at least once
        self._early: list[int] = []  # ranks that exited 0 without building one, in exit order

    def saw(self, rank: int, phase: str) -> None:
        """Rank ``rank`` announced ``phase`` (one of ``varuna.core.lifecycle.PHASES``)."""
        if phase not in PHASES:
            raise ValueError(f"unknown lifecycle phase {phase!r}; use one of {', '.join(PHASES)}")
        self._phase[rank] = phase
        if phase == BUILT:
            self._built.add(rank)

    def exited(self, rank: int, code: int) -> None:
        """Rank ``rank`` exited with ``code``; an exit 0 without an Engine is remembered."""
        if code == 0 and rank not in self._built and rank not in self._early:
            self._early.append(rank)

    def phase(self, rank: int) -> str | None:
        """The last phase ``rank`` announced, None when it announced none."""
        return self._phase.get(rank)

    def waiting(self, running: Iterable[int]) -> list[int]:
        """The ranks of ``running`` that wait for the others (in the rendezvous or past it)."""
        return [r for r in running if self._phase.get(r) in _WAITING]

    def culprit(self, running: Iterable[int]) -> int | None:
        """The first rank that exited 0 without building its Engine -- and has not announced
        ``built`` since (its line may be read after its exit was seen) -- while a rank of
        ``running`` waits; None otherwise."""
        early = [r for r in self._early if r not in self._built]
        if not early or not self.waiting(running):
            return None
        return early[0]


def early_exit_line(where: str, code: int, *, waiting: Iterable[int]) -> str:
    """The job's one line for a culprit (:meth:`EarlyExits.culprit`) at ``where`` (its rank,
    stage, replica and host) that exited with ``code``, the ``waiting`` ranks named.

    Example::

        >>> early_exit_line("rank 2 stage 0 replica 1", 0, waiting=[0, 1, 3])  # doctest: +ELLIPSIS
        'rank 2 stage 0 replica 1 exited with code 0 before building its Engine, while ranks 0, 1, 3 wait...'
    """
    ranks = sorted(waiting)
    who = f"rank {ranks[0]} waits" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} wait"
    return (f"{where} exited with code {code} before building its Engine, while {who} for it: every rank "
            "must construct varuna.Engine (or the live trainer); check the script for an early return "
            "or sys.exit on some ranks")
