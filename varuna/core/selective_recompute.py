"""Per-segment (selective) recompute: which segments of a recomputed micro-batch recompute their
activations and which keep them (issue #32; docs/memory.md).

Note [Selective recompute]: the schedule kind decides *which micro-batches* a stage recomputes
(``Schedule.recomputed``); the recompute set ``S`` (global segment indices,
``PipelineConfig.recompute_segments``) decides *which of the stage's segments*. A recomputed
micro-batch's forward runs the stage as *blocks*: maximal runs of consecutive segments that are
all in ``S`` (recomputed blocks) or all outside it (kept blocks). A kept block runs with autograd
and keeps its graph until the backward; a recomputed block runs without one, stashing its input
(the previous block's output, whose storage the next block's graph holds anyway), and its R
rebuilds its graph from that stash. The backward walks the blocks in reverse, each block's input
gradient being the gradient of the block before it. A block boundary is a stage boundary inside
one process: its sub-forward runs the user's forward with placeholders outside the block and
carried values crossing it (Note [Carried values] in varuna/cutting/cutpoint.py), exactly as a
pipeline cut at that CutPoint would. So a deterministic run gives the same bits whatever ``S``
(every layout of the cut points already does), and nothing new can go wrong: a model that
trains at every P trains with every ``S``.

Memory per in-flight micro-batch: each block's input (what a recomputed block stashes and a
kept block's graph holds) plus the kept segments' activations; during one micro-batch's R and
B the recomputed segments' activations as well (:func:`selective_dynamic_bytes`). ``S`` empty is
"keep everything" (the R tasks then do nothing), ``S`` covering the stage is whole-stage recompute.
Time: each recomputed segment is forwarded twice, and each block after the stage's first pays the
placeholders of the segments before it (one more pass of the user's forward glue).

The planner picks ``S`` per stage with :func:`choose_recompute_segments`: the fewest seconds of
recompute that fit the memory, greedily by activation bytes freed per second of recompute (the
rule Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
apply by hand to attention's cheap, large tensors; PTD-P's √(l·A) rule minimises memory instead).

Example::

    >>> recompute_blocks(2, 6, {3, 4, 9})
    [(2, 2, False), (3, 4, True), (5, 6, False)]
    >>> recompute_blocks(2, 6, None)   # no set: the whole stage recomputes
    [(2, 6, True)]
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

__all__ = [
    "recompute_set", "recompute_blocks", "selective_dynamic_bytes", "choose_recompute_segments",
    "check_recompute_segments", "parse_segment_set",
]


def recompute_set(segments: Collection[int] | None, num_segments: int) -> frozenset[int] | None:
    """``PipelineConfig.recompute_segments`` checked against the model's ``num_segments``, as a
    set (None stays None: whole-stage recompute); ``ValueError`` (one line) when it is wrong."""
    problem = check_recompute_segments(segments, num_segments)
    if problem is not None:
        raise ValueError(problem)
    return None if segments is None else frozenset(segments)


def recompute_blocks(first: int, last: int, segments: Collection[int] | None) -> list[tuple[int, int, bool]]:
    """The blocks (first, last, recomputed) of segments [first, last] under recompute set ``segments``
    (None: every segment recomputes)."""
    if segments is None:
        return [(first, last, True)]
    out: list[tuple[int, int, bool]] = []
    for s in range(first, last + 1):
        r = s in segments
        if out and out[-1][2] == r:
            out[-1] = (out[-1][0], s, r)
        else:
            out.append((s, s, r))
    return out


def selective_dynamic_bytes(
    first: int,
    last: int,
    segments: Collection[int] | None,
    stashed: int,
    input_bytes: Callable[[int], float],
    activation_bytes: Callable[[int], float],
) -> float:
    """In-flight activation bytes of a recomputing stage [first, last] holding ``stashed``
    micro-batches under recompute set ``segments`` (Note [Selective recompute]):
    ``stashed`` × (each block's input + the kept segments' activations) + the recomputed segments'
    activations of the one micro-batch being recomputed. ``input_bytes(s)``: bytes entering segment s
    for one micro-batch; ``activation_bytes(s)``: what autograd saves in segment s for one.

    >>> selective_dynamic_bytes(0, 3, None, 2, lambda s: 1, lambda s: 10)   # 2×1 + 40
    42.0
    >>> selective_dynamic_bytes(0, 3, set(), 2, lambda s: 1, lambda s: 10)  # 2×(1 + 40)
    82.0
    >>> selective_dynamic_bytes(0, 3, {2, 3}, 2, lambda s: 1, lambda s: 10)  # 2×(1 + 1 + 20) + 20
    64.0
    """
    per_mb, once = 0.0, 0.0
    for a, b, rec in recompute_blocks(first, last, segments):
        per_mb += input_bytes(a)
        acts = sum(activation_bytes(s) for s in range(a, b + 1))
        if rec:
            once += acts
        else:
            per_mb += acts
    return float(stashed * per_mb + once)


def choose_recompute_segments(
    first: int,
    last: int,
    fits: Callable[[frozenset[int]], bool],
    activation_bytes: Sequence[float],
    recompute_s: Sequence[float],
) -> frozenset[int] | None:
    """The recompute set for segments [first, last]: none if keeping every activation ``fits``,
    else segments added greedily, most activation bytes per second of recompute first, until it
    fits (Note [Selective recompute]); None when even the whole stage recomputing does not fit.
    ``activation_bytes`` and ``recompute_s`` are per global segment.

    >>> acts, secs = [10, 40, 10, 40], [1.0, 1.0, 1.0, 4.0]
    >>> sorted(choose_recompute_segments(0, 3, lambda s: sum(acts[i] for i in s) >= 40, acts, secs))
    [1]
    >>> choose_recompute_segments(0, 3, lambda s: False, acts, secs) is None
    True
    """
    chosen: set[int] = set()
    if fits(frozenset(chosen)):
        return frozenset()
    order = sorted(range(first, last + 1),
                   key=lambda s: (-activation_bytes[s] / max(recompute_s[s], 1e-12), s))
    for s in order:
        chosen.add(s)
        if fits(frozenset(chosen)):
            return frozenset(chosen)
    return None


def check_recompute_segments(segments: object, num_segments: int | None = None) -> str | None:
    """What is wrong with ``segments`` as ``PipelineConfig.recompute_segments`` (one line), or None;
    with ``num_segments`` (the model's, once known) an index past the last segment too.

    >>> check_recompute_segments((1, 2)) is None
    True
    >>> check_recompute_segments((1, -2))
    'pipeline.recompute_segments must be segment indices >= 0 (a tuple of ints), got (1, -2)'
    """
    if segments is None:
        return None
    ok = isinstance(segments, (tuple, list, frozenset, set)) and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in segments)
    if not ok:
        return f"pipeline.recompute_segments must be segment indices >= 0 (a tuple of ints), got {segments!r}"
    if num_segments is not None and any(s >= num_segments for s in segments):
        return (f"pipeline.recompute_segments names segment {max(segments)} but the model has {num_segments} "
                f"segments (0-{num_segments - 1}); drop the indices past the last one")
    return None


def parse_segment_set(text: str, option: str = "--recompute-segments") -> tuple[int, ...]:
    """The recompute set written as ``--recompute-segments`` and ``VARUNA_RECOMPUTE_SEGMENTS``
    take it: segment indices and inclusive ranges, comma-separated, or ``none`` (recompute no
    segment); sorted, each once. ``ValueError`` (one line naming ``option`` and the form) when
    malformed; indices past the model's last segment are checked where the model is known
    (:func:`recompute_set`, auto-config against its calibration).

    >>> parse_segment_set("0,2-3")
    (0, 2, 3)
    >>> parse_segment_set(" 3, 1 ,1 ")
    (1, 3)
    >>> parse_segment_set("none")
    ()
    >>> parse_segment_set("2-a")
    Traceback (most recent call last):
    ValueError: --recompute-segments '2-a': not segment indices and ranges; write e.g. 0,2-3 (or none)
    """
    raw = text.strip()
    if raw.lower() == "none":
        return ()
    form = f"{option} {text!r}: not segment indices and ranges; write e.g. 0,2-3 (or none)"
    out: set[int] = set()
    for part in raw.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.strip().isdigit() or (dash and not hi.strip().isdigit()):
            raise ValueError(form)
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{option} {text!r}: range {first}-{last} runs backwards; write {last}-{first}")
        out.update(range(first, last + 1))
    return tuple(sorted(out))
