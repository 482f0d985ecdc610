"""Stage state sent peer to peer as one flat byte buffer per (sender, receiver) pair (live morph).

A stage's state is parameters plus name-keyed optimizer state (``optimizer_state_by_name``). Its
tensors travel as one contiguous uint8 buffer, each tensor's bytes at an 8-byte aligned offset;
the small rest (names, dtypes, shapes, offsets, hyper-parameters) travels as JSON through the
rendezvous store. No pickling and no ``torch.save``: packing is one copy, unpacking is views.

Example::

    >>> w = torch.arange(3.0)
    >>> meta, buf = pack_state({"params": {"w": w}, "optimizer": {"class": "SGD", "state": {},
    ...                         "param_groups": [{"lr": 0.1, "params": ["w"]}]}})
    >>> unpack_state(meta, buf)["params"]["w"].tolist()
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = ["pack_state", "unpack_state"]

_ALIGN = 8


def pack_state(state: dict) -> tuple[str, torch.Tensor]:
    """``(meta_json, buffer)`` for ``{"params": {name: tensor}, "optimizer": {...}}`` (CPU copy)."""
    entries: list[list[Any]] = []
    chunks: list[torch.Tensor] = []
    offset = 0

    def put(t: torch.Tensor) -> dict:
        nonlocal offset
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        pad = -offset % _ALIGN
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8))
        offset += pad
        ref = {"@t": len(entries)}
        entries.append([offset, str(t.dtype).removeprefix("torch."), list(t.shape)])
        chunks.append(raw)
        offset += raw.numel()
        return ref

    opt = state["optimizer"]
    skeleton = {
        "params": {n: put(t) for n, t in state["params"].items()},
        "optimizer": {
            "class": opt.get("class"),
            "state": {n: {k: put(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for n, s in opt.get("state", {}).items()},
            "param_groups": opt.get("param_groups", []),
        },
    }
    buf = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return json.dumps({"entries": entries, "skeleton": skeleton}), buf


def unpack_state(meta: str, buf: torch.Tensor) -> dict:
    """Inverse of :func:`pack_state`; the tensors are views of ``buf``."""
    m = json.loads(meta)
    tensors = []
    for off, dtype, shape in m["entries"]:
        # The description comes through the store: accept only a real dtype and an extent inside
        # the buffer (a bad one is an error, never an arbitrary attribute or an out-of-range view).
        dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(dt, torch.dtype) or not all(isinstance(x, int) and x >= 0 for x in [off, *shape]):
            raise ValueError(f"live transfer: bad tensor entry {off!r}, {dtype!r}, {shape!r}")
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dt).element_size()
        if off + nbytes > buf.numel():
            raise ValueError(f"live transfer: entry at {off} of {nbytes} bytes overruns the "
                             f"{buf.numel()}-byte buffer")
        tensors.append(buf[off:off + nbytes].view(dt).reshape(shape))

    def get(v):
        return tensors[v["@t"]] if isinstance(v, dict) and "@t" in v else v

    sk = m["skeleton"]
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in sk["optimizer"]["param_groups"]]  # JSON made tuples (AdamW's betas) lists
    state = {n: {k: get(v) for k, v in s.items()} for n, s in sk["optimizer"]["state"].items()}
    return {"params": {n: get(v) for n, v in sk["params"].items()},
            "optimizer": {"class": sk["optimizer"]["class"], "state": state, "param_groups": groups}}
