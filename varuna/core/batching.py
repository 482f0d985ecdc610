"""How a mini-batch is cut into micro-batches and shared among data-parallel replicas.

Micro-batches are defined globally, independent of D: the M_total examples are cut into
ceil(M_total / m) micro-batches of m (the last may be smaller), numbered 0, 1, ... Replica d
takes a contiguous run of them: counts differ by at most one, or, with ``shares`` (virtual
nodes, for replicas on VMs of different speeds), replica d takes exactly ``shares[d]`` of them.
Randomness is keyed by the *global* micro-batch index, so the same mini-batch sees the same
dropout masks at any P×D and any shares; each micro-batch's gradient is weighted by its size
over M_total wherever it runs, so uneven shares compute the same update.

Example::

    >>> [[mb.index for mb in replica] for replica in plan_microbatches(10, 4, 2)]
    [[0, 1], [2]]
    >>> microbatch_counts(10, 4, 2)   # the same split, counted: (per replica, its last one's size)
    ((2, 1), (4, 2))
    >>> [[mb.index for mb in replica] for replica in plan_microbatches(16, 4, 2, shares=(3, 1))]
    [[0, 1, 2], [3]]
    >>> proportional_shares([1.6, 1.0], 8)   # micro-batches per replica by relative speed
    (5, 3)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MicroBatch", "check_shares", "microbatch_counts", "plan_microbatches", "proportional_shares"]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    index: int  # global micro-batch index within the mini-batch
    start: int  # first example (inclusive)
    end: int  # last example (exclusive)

    @property
    def size(self) -> int:
        return self.end - self.start


def check_shares(shares: Sequence[int], num_microbatches: int, data_parallel: int) -> str | None:
    """Why ``shares`` (micro-batches per replica) cannot split ``num_microbatches`` among
    ``data_parallel`` replicas, as one line naming the fix; None when they can.

    >>> check_shares((3, 1), 4, 2) is None
    True
    >>> check_shares((3, 2), 4, 2)
    'replica_shares (3, 2) sum to 5 but the mini-batch has 4 micro-batch(es); give 2 counts >= 1 summing to 4'
    """
    shares = tuple(shares)
    fix = f"give {data_parallel} counts >= 1 summing to {num_microbatches}"
    if any(isinstance(x, bool) or not isinstance(x, int) for x in shares):
        return f"replica_shares {shares} must be whole numbers of micro-batches; {fix}"
    if len(shares) != data_parallel:
        return (
            f"replica_shares {shares} has {len(shares)} count(s) but there are D={data_parallel} "
            f"replicas; {fix}"
        )
    if min(shares) < 1:
        return f"replica_shares {shares} leaves a replica without micro-batches; {fix}"
    if sum(shares) != num_microbatches:
        return (
            f"replica_shares {shares} sum to {sum(shares)} but the mini-batch has {num_microbatches} "
            f"micro-batch(es); {fix}"
        )
    return None


def proportional_shares(speeds: Sequence[float], num_microbatches: int) -> tuple[int, ...]:
    """Micro-batches per replica proportional to ``speeds`` (relative throughputs), each >= 1,
    summing to ``num_microbatches`` (largest remainders; ties to the lower replica index).

    >>> proportional_shares([1, 1, 2], 8)
    (2, 2, 4)
    """
    speeds = [float(v) for v in speeds]
    D, n = len(speeds), num_microbatches
    if D < 1 or not all(v > 0 and v != float("inf") for v in speeds):
        raise ValueError(f"replica speeds must be finite and > 0, one per replica (got {speeds})")
    if n < D:
        raise ValueError(
            f"{n} micro-batch(es) cannot give each of {D} replicas one; use a smaller micro-batch"
        )
    total = sum(speeds)
    # One each first (every replica must run), the rest by speed.
    ideal = [1 + (n - D) * v / total for v in speeds]
    out = [int(x) for x in ideal]
    order = sorted(range(D), key=lambda d: (-(ideal[d] - out[d]), d))
    for d in order[: n - sum(out)]:
        out[d] += 1
    return tuple(out)


def microbatch_counts(
    global_batch_size: int, micro_batch_size: int, data_parallel: int, shares: Sequence[int] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per replica, how many micro-batches :func:`plan_microbatches` gives it, and the size of its
    last one, without building them (the simulator and auto-config count millions of examples).
    ``shares``: micro-batches per replica (:func:`check_shares`); default: as even as possible.

    >>> microbatch_counts(9, 2, 2)
    ((3, 2), (2, 1))
    >>> microbatch_counts(9, 2, 2, shares=(4, 1))
    ((4, 1), (2, 1))
    """
    M, m, D = global_batch_size, micro_batch_size, data_parallel
    if m < 1 or M < 1 or D < 1:
        raise ValueError(f"batch sizes and D must be >= 1 (global {M}, micro {m}, D {D})")
    if M < D:
        raise ValueError(
            f"global batch size {M} is smaller than data-parallel degree D={D}: some replica would get "
            f"nothing; use --global-batch-size >= {D} or fewer replicas"
        )
    n = -(-M // m)
    if n < D:
        raise ValueError(
            f"global batch {M} at micro-batch size {m} gives {n} micro-batch(es), fewer than D={D} replicas; "
            f"use --micro-batch-size <= {M // D}"
        )
    if shares is None:
        counts = tuple(n // D + (1 if d < n % D else 0) for d in range(D))
    else:
        problem = check_shares(shares, n, D)
        if problem is not None:
            raise ValueError(problem)
        counts = tuple(shares)
    # Only the mini-batch's final micro-batch may be short, and the last replica holds it.
    last = (m,) * (D - 1) + (M - (n - 1) * m,)
    return counts, last


def plan_microbatches(
    global_batch_size: int, micro_batch_size: int, data_parallel: int, shares: Sequence[int] | None = None
) -> list[list[MicroBatch]]:
    """Per replica, its micro-batches (see module docstring); ``shares`` as in :func:`microbatch_counts`."""
    M, m = global_batch_size, micro_batch_size
    counts, _ = microbatch_counts(M, m, data_parallel, shares)
    mbs = [MicroBatch(i, i * m, min((i + 1) * m, M)) for i in range(sum(counts))]
    out, pos = [], 0
    for cnt in counts:
        out.append(mbs[pos : pos + cnt])
        pos += cnt
    return out
