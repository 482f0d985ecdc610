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

Ranges are ``(first, last)`` segment indices, inclusive.

Example::

    >>> balanced_partition([1, 1, 4, 1, 1, 1], 3)
    [(0, 1), (2, 2), (3, 5)]
    >>> balanced_stages([3, 3, 3, 3], [2, 2, 2, 2], 2)   # last stage is cheaper: it takes 3
    [(0, 0), (1, 3)]
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = ["balanced_partition", "balanced_stages", "candidate_maxima", "stage_costs", "stage_of_segment"]


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
    capacity: float = math.inf,
) -> list[tuple[int, int]]:
    """Contiguous ranges of segments for ``num_stages`` stages minimising the costliest stage.

    ``full[i]``: cost of segment i on a non-last stage (F+R+B); ``last[i]``: on the last stage
    (F+B). ``candidates`` (from :func:`candidate_maxima`) can be passed to reuse the sort across
    pipeline depths. With ``weights`` (e.g. bytes of parameters, gradients and optimizer state)
    every stage's summed weight must also stay within ``capacity``; ``ValueError`` if impossible.

    >>> balanced_stages([1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], 3)
    [(0, 1), (2, 3), (4, 5)]
    >>> balanced_stages([3, 3, 3, 3], [2, 2, 2, 2], 2, weights=[1, 1, 1, 1], capacity=2)
    [(0, 1), (2, 3)]
    """
    n = len(full)
    if len(last) != n or (weights is not None and len(weights) != n):
        raise ValueError("cost and weight lists differ in length")
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot split {n} segments into {num_stages} stages; use a pipeline depth between 1 "
            f"and {n} (the number of cut-points + 1)"
        )
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


def stage_costs(
    full: Sequence[float], last: Sequence[float], ranges: Sequence[tuple[int, int]]
) -> list[float]:
    """Cost of each stage of ``ranges`` (the last uses ``last`` costs)."""
    out = []
    for k, (a, b) in enumerate(ranges):
        src = last if k == len(ranges) - 1 else full
        out.append(sum(src[a : b + 1]))
    return out


def balanced_partition(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """:func:`balanced_stages` when every stage, the last included, pays the same cost per segment."""
    for c in costs:
        if c < 0:
            raise ValueError(f"segment costs must be >= 0, got {c}")
    return balanced_stages(costs, costs, num_stages)


def stage_of_segment(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Inverse map: segment index -> stage index."""
    out = []
    for k, (a, b) in enumerate(ranges):
        out.extend([k] * (b - a + 1))
    return out
