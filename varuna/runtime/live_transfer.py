"""Stage state sent peer to peer tensor by tensor, straight from and into the live tensors (live morph).

A stage's state is parameters, persistent buffers and name-keyed optimizer state
(``optimizer_state_by_name``). The
sender posts each of its tensors as it is (no packing copy: the held engine no longer trains, so
its tensors are stable); the receiver receives a parameter straight into the new engine's own
parameter and optimizer state into fresh tensors that the optimizer then adopts without a copy.
The small rest (names, dtypes, shapes, hyper-parameters) travels as JSON through the rendezvous
store. No pickling and no ``torch.save``; tensor ``i`` of the description goes with message tag ``i``.

Example::

    >>> w, into = torch.arange(3.0), torch.zeros(3)
    >>> meta, out = describe_state({"params": {"w": w}, "optimizer": {"class": "SGD", "state": {},
    ...                             "param_groups": [{"lr": 0.1, "params": ["w"]}]}})
    >>> state, targets = receive_targets(meta, {"w": into})
    >>> for src, dst in zip(out, targets):
    ...     _ = dst.copy_(src)                     # what the send/recv pair does
    >>> into.tolist(), state["params"]["w"] is into
    ([0.0, 1.0, 2.0], True)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["describe_state", "receive_targets"]


def describe_state(state: dict) -> tuple[str, list[torch.Tensor]]:
    """``(meta_json, tensors)`` for ``{"params": {name: tensor}, "buffers": {name: tensor},
    "optimizer": {...}}`` (``buffers`` optional): the tensors to send in order (the live ones, CPU
    and contiguous: no copy unless they are not)."""
    entries: list[list[Any]] = []
    tensors: list[torch.Tensor] = []

    def put(t: torch.Tensor) -> dict:
        ref = {"@t": len(entries)}
        entries.append([str(t.dtype).removeprefix("torch."), list(t.shape)])
        tensors.append(t.detach().to("cpu").contiguous())
        return ref

    opt = state["optimizer"]
    skeleton = {
        "params": {n: put(t) for n, t in state["params"].items()},
        "buffers": {n: put(t) for n, t in state.get("buffers", {}).items()},
        "optimizer": {
            "class": opt.get("class"),
            "state": {n: {k: put(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for n, s in opt.get("state", {}).items()},
            "param_groups": opt.get("param_groups", []),
        },
    }
    return json.dumps({"entries": entries, "skeleton": skeleton}), tensors


def receive_targets(meta: str, into: Mapping[str, torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
    """The state :func:`describe_state` described, and the tensors to receive it into, in order: a
    parameter named in ``into`` (the new engine's, contiguous, same dtype and shape) is received
    in place (so is a buffer); everything else into a fresh tensor. Raises ValueError on a bad
    description."""
    m = json.loads(meta)
    sk = m["skeleton"]
    named = {**sk.get("buffers", {}), **sk["params"]}
    param_of = {v["@t"]: n for n, v in named.items() if isinstance(v, dict) and "@t" in v}
    targets = []
    for i, entry in enumerate(m["entries"]):
        # The description comes through the store: accept only a real dtype and a sane shape.
        dtype, shape = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
        dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(dt, torch.dtype) or not isinstance(shape, list) or \
                not all(isinstance(x, int) and x >= 0 for x in shape):
            raise ValueError(f"live transfer: bad tensor entry {entry!r}")
        own = into.get(param_of.get(i, ""))
        if own is not None and own.dtype == dt and list(own.shape) == shape and own.is_contiguous() \
                and own.device.type == "cpu":
            targets.append(own)
        else:
            targets.append(torch.empty(shape, dtype=dt))

    def get(v):
        return targets[v["@t"]] if isinstance(v, dict) and "@t" in v else v

    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in sk["optimizer"]["param_groups"]]  # JSON made tuples (AdamW's betas) lists
    state = {n: {k: get(v) for k, v in s.items()} for n, s in sk["optimizer"]["state"].items()}
    return ({"params": {n: get(v) for n, v in sk["params"].items()},
             "buffers": {n: get(v) for n, v in sk.get("buffers", {}).items()},
             "optimizer": {"class": sk["optimizer"]["class"], "state": state, "param_groups": groups}},
            targets)
