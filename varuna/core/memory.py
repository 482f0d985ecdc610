"""Memory facts the runtime and the planner share (issue #32, docs/memory.md): what a stage's
process holds beyond its parameters, gradients, optimizer state and activations.

Example::

    >>> comm_buffer_bytes(replicas=1, grad_bytes=1 << 30)
    0
    >>> comm_buffer_bytes(replicas=2, grad_bytes=1 << 30) == GRAD_BUCKET_BYTES
    True
"""

from __future__ import annotations

__all__ = [
    "ENGINE_OVERHEAD_BYTES", "GRAD_BUCKET_BYTES", "MEMORY_MARGIN", "WORKSPACE_FACTOR", "comm_buffer_bytes",
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
