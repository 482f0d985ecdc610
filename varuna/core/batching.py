"""How a mini-batch is cut into micro-batches and shared among data-parallel replicas.

Micro-batches are defined globally, independent of D: the M_total examples are cut into
ceil(M_total / m) micro-batches of m (the last may be smaller), numbered 0, 1, ... Replica d
takes a contiguous run of them (counts differ by at most one). Randomness is keyed by the
*global* micro-batch index, so the same mini-batch sees the same dropout masks at any P×D.

Example::

    >>> [[mb.index for mb in replica] for replica in plan_microbatches(10, 4, 2)]
    [[0, 1], [2]]
    >>> microbatch_counts(10, 4, 2)   # the same split, counted: (per replica, its last one's size)
    ((2, 1), (4, 2))
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MicroBatch", "microbatch_counts", "plan_microbatches"]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    index: int  # global micro-batch index within the mini-batch
    start: int  # first example (inclusive)
    end: int  # last example (exclusive)

    @property
    def size(self) -> int:
        return self.end - self.start


def microbatch_counts(
    global_batch_size: int, micro_batch_size: int, data_parallel: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per replica, how many micro-batches :func:`plan_microbatches` gives it, and the size of its
    last one, without building them (the simulator and auto-config count millions of examples).

    >>> microbatch_counts(9, 2, 2)
    ((3, 2), (2, 1))
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
    counts = tuple(n // D + (1 if d < n % D else 0) for d in range(D))
    # Only the mini-batch's final micro-batch may be short, and the last replica holds it.
    last = (m,) * (D - 1) + (M - (n - 1) * m,)
    return counts, last


def plan_microbatches(
    global_batch_size: int, micro_batch_size: int, data_parallel: int
) -> list[list[MicroBatch]]:
    """Per replica, its micro-batches (see module docstring)."""
    M, m = global_batch_size, micro_batch_size
    counts, _ = microbatch_counts(M, m, data_parallel)
    mbs = [MicroBatch(i, i * m, min((i + 1) * m, M)) for i in range(sum(counts))]
    out, pos = [], 0
    for cnt in counts:
        out.append(mbs[pos : pos + cnt])
        pos += cnt
    return out
