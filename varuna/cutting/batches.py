"""A user's batch (a tensor, a tuple/list or a dict of tensors): its size, slicing it into
micro-batches, and the convention for passing it to the model.

The plan of which examples form which micro-batch is pure data (:mod:`varuna.core.batching`);
this module applies it to tensors.

    >>> import torch
    >>> slice_batch({"x": torch.arange(6), "n": 3}, 2, 4)
    {'x': tensor([2, 3]), 'n': 3}
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["batch_size_of", "call_with_batch", "slice_batch", "to_device", "to_meta"]


def batch_size_of(batch) -> int:
    """Leading dimension shared by every tensor of ``batch`` (tensor, tuple/list or dict)."""
    leaves = (
        list(batch.values())
        if isinstance(batch, dict)
        else list(batch)
        if isinstance(batch, (list, tuple))
        else [batch]
    )
    sizes = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"every tensor of a batch must share its first (batch) dimension; got sizes {sorted(sizes)}"
        )
    return sizes.pop()


def slice_batch(batch, start: int, end: int):
    """Examples ``start:end`` of every tensor in ``batch``; other values are passed through."""
    def cut(x):
        return x[start:end] if isinstance(x, torch.Tensor) and x.dim() > 0 else x

    if isinstance(batch, dict):
        return {k: cut(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cut(v) for v in batch)
    return cut(batch)


def call_with_batch(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` the way every part of varuna does: a dict as keyword arguments, a tuple or list
    as positional arguments, anything else as the one argument."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def to_device(tree: Any, device: torch.device | str) -> Any:
    """``tree`` (a batch) with every tensor on ``device`` (those already there are not copied).

    Host-to-device copies are issued ``non_blocking`` (device-to-host ones never are): from
    pageable memory CUDA stages the bytes before the call returns (the caller may reuse the batch
    at once) without waiting for the device, and from pinned memory (a
    ``DataLoader(pin_memory=True)`` batch) the copy overlaps compute; either way it is ordered
    on the current stream before the kernels that read it.

    >>> to_device({"x": torch.ones(2), "n": 3}, "cpu")
    {'x': tensor([1., 1.]), 'n': 3}
    """
    device = torch.device(device)
    leaves, spec = tree_flatten(tree)
    if not any(isinstance(x, torch.Tensor) and x.device != device for x in leaves):
        return tree
    # Never non_blocking into host memory: the caller would read it before the copy lands.
    asynchronous = device.type != "cpu"
    return tree_unflatten(
        [x.to(device, non_blocking=asynchronous) if isinstance(x, torch.Tensor) else x for x in leaves], spec
    )


def to_meta(tree: Any) -> Any:
    """``tree`` (a batch, or call arguments) with every tensor replaced by an empty ``meta`` tensor
    of its shape and dtype: what a dry run of a ``meta`` model takes.

    >>> to_meta({"x": torch.zeros(2, 3), "n": 3})
    {'x': tensor(..., device='meta', size=(2, 3)), 'n': 3}
    """
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(
        [torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
         for x in leaves],
        spec,
    )
