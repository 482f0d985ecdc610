"""Stage assignment: group consecutive segments into P stages with balanced cost.

Pure Python, shared by the runtime (dry-run costs) and the simulator/auto-config (calibrated
costs). A stage's cost is the sum of its segments' F+R+B, except on the last stage, which never
recomputes under Varuna (F+B). We minimise the most expensive stage: the pipeline's steady state
runs at the pace of its slowest stage. Light trailing segments such as an LM head therefore end
up on the last stage whenever that keeps the maximum lowest, as in the paper.

Method: binary search over the candidate maxima (every contiguous sum of full costs and every
suffix sum of last-stage costs), each tested in O(K) — the last stage takes a suffix, and the rest
is a prefix split by greedy-from-the-left, which is optimal for every prefix at once. For K=96
cut-points that is ~5k candidates sorted once and ~13 O(K) tests per pipeline depth.

Stages on VMs of different speeds (``speeds``, relative throughput per stage, in pipeline
order): a segment costing c takes c / speeds[i] on stage i, and the most expensive stage *time* is
minimised, so a stage on a slower VM gets less of the model. Stage order fixes which VM holds
which stage, so the greedy test above no longer applies (a slow stage can make a single segment
too costly for it alone); an exact O(P·K²) dynamic programme over (stage, first segment) is used
instead (K=96, P=36: ~0.2 M steps). Equal speeds take the homogeneous path, whose plans do not move.

Ranges are ``(first, last)`` segment indices, inclusive.

Example::

    >>> balanced_partition([1, 1, 4, 1, 1, 1], 3)
    [(0, 1), (2, 2), (3, 5)]
    >>> balanced_stages([3, 3, 3, 3], [2, 2, 2, 2], 2)   # last stage is cheaper: it takes 3
    [(0, 0), (1, 3)]
    >>> balanced_partition([1, 1, 1, 1, 1, 1], 2, speeds=[2, 1])   # stage 0 is twice as fast
    [(0, 3), (4, 5)]
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

__all__ = [
    "balanced_partition",
    "balanced_stages",
    "candidate_maxima",
    "check_speeds",
    "stage_costs",
    "stage_of_segment",
]


def candidate_maxima(full: Sequence[float], last: Sequence[float]) -> list[float]:
    """Sorted distinct values the optimal maximum stage cost can take."""
    n = len(full)
    out = set()
    for a in range(n):
        s = 0.0
        for b in range(a, n):
            s += full[b]
            out.add(s)
    s = 0.0
    for a in range(n - 1, -1, -1):
        s += last[a]
        out.add(s)
    return sorted(out)


def _split(
    full: Sequence[float],
    last: Sequence[float],
    num_stages: int,
    limit: float,
    weights: Sequence[float] | None = None,
    capacity: float = math.inf,
):
    """A partition into exactly ``num_stages`` stages with every cost <= limit (and every stage's
    summed ``weights`` <= capacity), or None."""
    n = len(full)
    w = weights if weights is not None else [0.0] * n
    eps = 1e-12 * max(limit, 1.0)
    wcap = capacity * (1 + 1e-12)
    # Greedy from the left: parts[s] = fewest parts for the prefix of length s. Both limits are
    # additive and hold for any sub-range of a feasible part, so greedy stays optimal.
    parts = [0] * (n + 1)
    count, cur, curw = 0, 0.0, 0.0
    for i, c in enumerate(full):
        if c > limit + eps or w[i] > wcap:
            # Segment i cannot sit in a non-last stage; only prefixes up to i are usable.
            parts[i + 1 :] = [n + 1] * (n - i)
            break
        if count == 0 or cur + c > limit + eps or curw + w[i] > wcap:
            count += 1
            cur, curw = c, w[i]
        else:
            cur += c
            curw += w[i]
        parts[i + 1] = count
    # The last stage is a suffix s..n-1; it must fit, and the prefix 0..s-1 must split into
    # exactly num_stages-1 non-empty parts: fewest-parts(prefix) <= num_stages-1 <= s.
    suffix, suffix_w = 0.0, 0.0
    best_s = None
    for s in range(n - 1, -1, -1):
        suffix += last[s]
        suffix_w += w[s]
        if suffix > limit + eps or suffix_w > wcap:
            break
        if (s == 0 and num_stages == 1) or (s >= num_stages - 1 >= 1 and parts[s] <= num_stages - 1):
            best_s = s  # keep going: a longer last stage leaves less for the prefix
    if best_s is None:
        return None
    if num_stages == 1:
        return [(0, n - 1)]
    # Rebuild the prefix's greedy parts, then split parts until there are enough.
    ranges: list[tuple[int, int]] = []
    a, cur, curw = 0, 0.0, 0.0
    for i in range(best_s):
        if i > a and (cur + full[i] > limit + eps or curw + w[i] > wcap):
            ranges.append((a, i - 1))
            a, cur, curw = i, 0.0, 0.0
        cur += full[i]
        curw += w[i]
    ranges.append((a, best_s - 1))
    # Splitting a part never raises a maximum: split the costliest splittable part where its
    # halves are most even, until there are enough parts.
    extra = num_stages - 1 - len(ranges)
    if extra > 0:
        prefix = [0.0]
        for c in full[:best_s]:
            prefix.append(prefix[-1] + c)
        heap = [(-(prefix[y + 1] - prefix[x]), x, y) for x, y in ranges]
        heapq.heapify(heap)
        done: list[tuple[int, int]] = []
        while extra > 0:
            _, x, y = heapq.heappop(heap)
            if y == x:
                done.append((x, y))  # cannot split; enough wider parts remain (best_s >= stages)
                continue
            total = prefix[y + 1] - prefix[x]
            cut = min(range(x, y), key=lambda c: abs(2 * (prefix[c + 1] - prefix[x]) - total))
            heapq.heappush(heap, (-(prefix[cut + 1] - prefix[x]), x, cut))
            heapq.heappush(heap, (-(prefix[y + 1] - prefix[cut + 1]), cut + 1, y))
            extra -= 1
        ranges = sorted(done + [(x, y) for _, x, y in heap])
    ranges.append((best_s, n - 1))
    return ranges


def balanced_stages(
    full: Sequence[float],
    last: Sequence[float],
    num_stages: int,
    *,
    candidates: Sequence[float] | None = None,
    weights: Sequence[float] | None = None,
    capacity: float | Sequence[float] = math.inf,
    speeds: Sequence[float] | None = None,
    fits: Callable[[int, int, int], bool] | None = None,
) -> list[tuple[int, int]]:
    """Contiguous ranges of segments for ``num_stages`` stages minimising the costliest stage.

    ``full[i]``: cost of segment i on a non-last stage (F+R+B); ``last[i]``: on the last stage
    (F+B). ``candidates`` (from :func:`candidate_maxima`) can be passed to reuse the sort across
    pipeline depths. With ``weights`` (e.g. bytes of parameters, gradients and optimizer state)
    every stage's summed weight must also stay within ``capacity`` -- one bound for every stage,
    or one per stage (VMs of different memory: Note [Memory-aware split]); ``ValueError`` if
    impossible. ``speeds[i]``: relative speed of stage i's device (its time is its cost / speeds[i]).
    ``fits(stage, first, last)``: whether stage ``stage`` may hold segments [first, last] (e.g. its
    whole memory, activations and stash included, within its capacity: not additive, since a
    stage's stash depends on its first segment and its place); the split then is the fastest of
    those where every stage fits (exact dynamic programme), ``ValueError`` when none does.

    Note [Memory-aware split]: the split minimises the slowest stage *subject to* every stage
    fitting its memory, never the memory itself: where the time-balanced split fits, it stands
    (a faster plan is never given up for memory that is not needed); where a stage would
    overflow, its weight bound moves segments to its neighbours, the least time lost. The callers
    (the runtime's ``assign_stages``, auto-config's ``fit``) pass each stage's memory minus what
    its activations need as the capacity, and per-segment static bytes (weights, gradients and
    optimizer state, the last divided by D when sharded) as the weights.

    >>> balanced_stages([1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], 3)
    [(0, 1), (2, 3), (4, 5)]
    >>> balanced_stages([3, 3, 3, 3], [2, 2, 2, 2], 2, weights=[1, 1, 1, 1], capacity=2)
    [(0, 1), (2, 3)]
    >>> balanced_stages([3, 3, 3, 3], [2, 2, 2, 2], 2, speeds=[1.0, 0.25])   # a slow last stage
    [(0, 2), (3, 3)]
    >>> balanced_stages([1, 1, 1, 1], [1, 1, 1, 1], 2, weights=[1] * 4, capacity=[1, 3])  # a small first VM
    [(0, 0), (1, 3)]
    >>> balanced_stages([1, 1, 1, 1], [1, 1, 1, 1], 2, fits=lambda k, a, b: k == 0 or a == b)  # 1 segment
    [(0, 2), (3, 3)]
    """
    n = len(full)
    if len(last) != n or (weights is not None and len(weights) != n):
        raise ValueError("cost and weight lists differ in length")
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot split {n} segments into {num_stages} stages; use a pipeline depth between 1 "
            f"and {n} (the number of cut-points + 1)"
        )
    if speeds is not None:
        problem = check_speeds(speeds, num_stages)
        if problem is not None:
            raise ValueError(problem)
    caps = _capacities(capacity, num_stages)
    if (speeds is not None and len(set(speeds)) > 1) or len(set(caps)) > 1 or fits is not None:
        sp = [float(v) for v in speeds] if speeds is not None else [1.0] * num_stages
        return _split_by_speed(full, last, sp, weights, caps, fits)
    capacity = caps[0]
    cands = list(candidates) if candidates is not None else candidate_maxima(full, last)
    lo, hi = 0, len(cands) - 1
    best = _split(full, last, num_stages, cands[hi], weights, capacity)
    if best is None:
        raise ValueError(
            f"no split of {n} segments into {num_stages} stages keeps every stage within {capacity:.6g}"
        )
    while lo < hi:
        mid = (lo + hi) // 2
        r = _split(full, last, num_stages, cands[mid], weights, capacity)
        if r is None:
            lo = mid + 1
        else:
            best, hi = r, mid
    return best


def _capacities(capacity: float | Sequence[float], num_stages: int) -> list[float]:
    if isinstance(capacity, (int, float)):
        return [float(capacity)] * num_stages
    caps = [float(c) for c in capacity]
    if len(caps) != num_stages:
        raise ValueError(f"{len(caps)} stage capacities for {num_stages} stages; give one per stage")
    return caps


def check_speeds(speeds: Sequence[float], num_stages: int) -> str | None:
    """Why ``speeds`` cannot be the per-stage speeds of a ``num_stages``-stage pipeline (one line
    naming the fix), or None.

    >>> print(check_speeds([1.0, 0.0], 2))
    stage_speeds [1.0, 0.0]: every speed must be finite and > 0 (relative throughput of the stage's VM)
    """
    speeds = list(speeds)
    if len(speeds) != num_stages:
        return (
            f"stage_speeds {speeds} has {len(speeds)} value(s) but the pipeline has P={num_stages} stages; "
            "give one per stage"
        )
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in speeds):
        return (
            f"stage_speeds {speeds}: every speed must be finite and > 0 "
            "(relative throughput of the stage's VM)"
        )
    return None


def _split_by_speed(
    full: Sequence[float],
    last: Sequence[float],
    speeds: list[float],
    weights: Sequence[float] | None,
    capacity: Sequence[float],
    fits: Callable[[int, int, int], bool] | None = None,
) -> list[tuple[int, int]]:
    """Exact min-max stage time for per-stage ``speeds``, weight bounds ``capacity`` and the
    predicate ``fits`` (see the module docstring and :func:`balanced_stages`)."""
    n, P = len(full), len(speeds)
    pf, pl, pw = [0.0], [0.0], [0.0]
    for i in range(n):
        pf.append(pf[-1] + full[i])
        pl.append(pl[-1] + last[i])
        pw.append(pw[-1] + (weights[i] if weights is not None else 0.0))
    wcap = [c * (1 + 1e-12) for c in capacity]
    inf = math.inf
    # best[k][j]: least max time of stages 0..k-1 (non-last) covering segments [0, j); arg for rebuild.
    best = [[inf] * (n + 1) for _ in range(P)]
    arg = [[-1] * (n + 1) for _ in range(P)]
    best[0][0] = 0.0
    for k in range(1, P):
        sp = speeds[k - 1]
        for j in range(k, n - (P - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or pw[j] - pw[i] > wcap[k - 1]:
                    continue
                t = max(best[k - 1][i], (pf[j] - pf[i]) / sp)
                # The predicate last: it may cost more than the sums (a stage's whole memory).
                if t < best[k][j] and (fits is None or fits(k - 1, i, j - 1)):
                    best[k][j], arg[k][j] = t, i
    top, cut = inf, -1
    for i in range(P - 1, n):
        if best[P - 1][i] == inf or pw[n] - pw[i] > wcap[P - 1]:
            continue
        t = max(best[P - 1][i], (pl[n] - pl[i]) / speeds[P - 1])
        if t < top and (fits is None or fits(P - 1, i, n - 1)):
            top, cut = t, i
    if cut < 0:
        caps = [f"{c:.6g}" for c in capacity]
        bound = caps[0] if len(set(caps)) == 1 else f"its capacity ({', '.join(caps)})"
        if fits is not None and all(c == math.inf for c in capacity):
            bound = "its memory"
        raise ValueError(f"no split of {n} segments into {P} stages keeps every stage within {bound}")
    ranges = [(cut, n - 1)]
    j = cut
    for k in range(P - 1, 0, -1):
        i = arg[k][j]
        ranges.append((i, j - 1))
        j = i
    return ranges[::-1]


def stage_costs(
    full: Sequence[float],
    last: Sequence[float],
    ranges: Sequence[tuple[int, int]],
    speeds: Sequence[float] | None = None,
) -> list[float]:
    """Cost of each stage of ``ranges`` (the last uses ``last`` costs); with ``speeds``, its time
    (cost / speed).

    >>> stage_costs([3, 3, 3, 3], [2, 2, 2, 2], [(0, 2), (3, 3)], speeds=[1.0, 0.25])
    [9.0, 8.0]
    """
    out = []
    for k, (a, b) in enumerate(ranges):
        src = last if k == len(ranges) - 1 else full
        c = sum(src[a : b + 1])
        out.append(c / speeds[k] if speeds is not None else c)
    return out


def balanced_partition(
    costs: Sequence[float], num_stages: int, speeds: Sequence[float] | None = None
) -> list[tuple[int, int]]:
    """:func:`balanced_stages` when every stage, the last included, pays the same cost per segment
    (divided by its ``speeds`` entry when given)."""
    for c in costs:
        if c < 0:
            raise ValueError(f"segment costs must be >= 0, got {c}")
    return balanced_stages(costs, costs, num_stages, speeds=speeds)


def stage_of_segment(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Inverse map: segment index -> stage index."""
    out = []
    for k, (a, b) in enumerate(ranges):
        out.extend([k] * (b - a + 1))
    return out
