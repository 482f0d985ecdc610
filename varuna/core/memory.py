"""Memory facts the runtime and the planner share (issue #32, docs/memory.md): what a stage's
process holds beyond its parameters, gradients, optimizer state and activations.

Example::

    >>> comm_buffer_bytes(replicas=1, grad_bytes=1 << 30)
    0
    >>> comm_buffer_bytes(replicas=2, grad_bytes=1 << 30) == GRAD_BUCKET_BYTES
    True
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from varuna.core.selective_recompute import selective_dynamic_bytes

__all__ = [
    "ENGINE_OVERHEAD_BYTES", "GRAD_BUCKET_BYTES", "MEMORY_MARGIN", "WORKSPACE_FACTOR",
    "activation_memory_bytes", "comm_buffer_bytes",
]

#: The gradient sync's flat buckets (``varuna.runtime.grad_sync.allreduce_bucketed``, and the
#: sharded optimizer's reduce-scatter and all-gather buckets): few large messages beat many
#: small, and one bucket at a time is what a sync adds to a stage's memory.
GRAD_BUCKET_BYTES = 32 << 20

#: A training process's own memory beyond what the memory model counts (the engine's buffers and
#: threads, autograd's workspace, the allocator's slack), measured on this project's CPU runs
#: (``scripts/validate_memory.py``: 43-57 MiB for a stage of P = 2, D = 1; docs/memory.md).
ENGINE_OVERHEAD_BYTES = 56 << 20

#: Note [Backward workspace]: besides what autograd saves, one micro-batch's forward and backward
#: hold transient tensors -- the forward's intermediates that are not saved, the gradients of the
#: saved activations while the backward walks them -- about as many bytes again as it saves. Measured
#: (docs/memory.md, ``scripts/validate_memory.py``): at every task boundary the live heap (glibc's
#: ``mallinfo2``) grew by what the model counts within 1-3 MiB, while the peak RSS lay above it by
#: 0.65-1.0 of one micro-batch's activations of the stage (GPT, 2×1, 1F1B and varuna). So a stage's
#: peak counts them once more, this factor times one micro-batch's saved activations.
WORKSPACE_FACTOR = 1.0

#: A share of a stage's memory also kept free by the memory-aware split (Note [Memory-aware
#: split] in varuna/core/partition.py): what grows with the model and is not counted.
MEMORY_MARGIN = 0.05


def comm_buffer_bytes(replicas: int, grad_bytes: int) -> int:
    """What the gradient sync adds to a stage with ``grad_bytes`` of gradients at ``replicas``
    replicas: one flat bucket (none without replicas)."""
    return 0 if replicas <= 1 else min(GRAD_BUCKET_BYTES, grad_bytes)


def activation_memory_bytes(
    first: int,
    last: int,
    *,
    stashed: int,
    recompute: bool,
    input_bytes: Callable[[int], float],
    activation_bytes: Callable[[int], float],
    recompute_segments: Collection[int] | None = None,
) -> float:
    """Activation memory of a stage made of segments [first, last] at its peak: the one formula
    the planner (``Calibration.stage_memory_bytes``, on calibrated per-segment bytes) and the
    runtime's memory-aware split (``StageMemory``, on the dry run's measured bytes) both use.

    ``stashed``: micro-batches in flight (forward done, backward not); ``input_bytes(s)``: bytes
    entering segment s for one micro-batch (segment 0: the micro-batch's tensors);
    ``activation_bytes(s)``: what autograd saves in segment s for one micro-batch (plus its
    outputs). Without ``recompute`` every in-flight micro-batch keeps its input and activations;
    with it each keeps its input (and, with ``recompute_segments``, its kept segments'
    activations: Note [Selective recompute]) and one micro-batch at a time holds the rest while
    it is recomputed and back-propagated. Either way one micro-batch's transients add
    ``WORKSPACE_FACTOR`` × its activations (Note [Backward workspace]).

    >>> ins, acts = (lambda s: 1.0), (lambda s: 10.0)
    >>> activation_memory_bytes(0, 1, stashed=3, recompute=False, input_bytes=ins, activation_bytes=acts)
    83.0
    >>> activation_memory_bytes(0, 1, stashed=3, recompute=True, input_bytes=ins, activation_bytes=acts)
    43.0
    >>> activation_memory_bytes(0, 1, stashed=3, recompute=True, input_bytes=ins, activation_bytes=acts,
    ...                         recompute_segments={1})   # 3 × (1 + 10 + 1) + 10 + 20
    66.0
    """
    acts = sum(activation_bytes(s) for s in range(first, last + 1))
    if recompute:
        # recompute_segments None: whole-stage recompute (one block holding every segment).
        dynamic = selective_dynamic_bytes(
            first, last, recompute_segments, stashed, input_bytes, activation_bytes)
    else:
        dynamic = stashed * (input_bytes(first) + acts)
    return float(dynamic + WORKSPACE_FACTOR * acts)
