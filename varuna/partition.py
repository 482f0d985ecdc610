"""Stage assignment: group consecutive segments into P stages with balanced cost.

Pure Python (shared with the simulator). The cost of a segment is its forward + backward time
measured in the dry run; the optimal contiguous split minimises the most expensive stage (the
pipeline's throughput is set by its slowest stage). Light trailing segments such as an LM head
end up on the last stage whenever that keeps the maximum lowest, as in the paper.

Example::

    >>> balanced_partition([1, 1, 4, 1, 1, 1], 3)
    [(0, 1), (2, 2), (3, 5)]
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_partition", "stage_of_segment"]


def balanced_partition(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Split segments ``0..len(costs)-1`` into ``num_stages`` contiguous, non-empty ranges
    ``(first, last)`` minimising the largest summed cost; ties prefer fewer segments on early
    stages (they hold more stashed activations under every schedule).
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot split {n} segments into {num_stages} stages; use a pipeline depth between 1 and {n} "
            f"(the number of CutPoints + 1)"
        )
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ValueError(f"segment costs must be >= 0, got {c}")
        prefix.append(prefix[-1] + c)

    def fits(limit: float) -> list[tuple[int, int]] | None:
        # Greedy from the back: give late stages as much as fits, so early stages get less.
        ranges, end = [], n
        for stages_left in range(num_stages, 0, -1):
            start = end - 1
            while start - 1 >= stages_left - 1 and prefix[end] - prefix[start - 1] <= limit:
                start -= 1
            if prefix[end] - prefix[start] > limit or start < stages_left - 1:
                return None
            ranges.append((start, end - 1))
            end = start
        if end != 0:
            return None
        return ranges[::-1]

    lo = max(costs)
    hi = prefix[-1]
    best = fits(hi)
    # Bisect on the limit; candidate limits are subarray sums, so 60 halvings reach float precision.
    for _ in range(60):
        if hi - lo <= 1e-12 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        r = fits(mid)
        if r is not None:
            best, hi = r, mid
        else:
            lo = mid
    r = fits(hi)
    return r if r is not None else best


def stage_of_segment(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Inverse map: segment index -> stage index."""
    out = []
    for k, (a, b) in enumerate(ranges):
        out.extend([k] * (b - a + 1))
    return out
