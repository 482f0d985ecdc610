"""Optimizer state keyed by parameter name, so a checkpoint loads into any stage split.

torch's ``Optimizer.state_dict`` numbers parameters by position in the optimizer's groups, which
change with the stage split; these functions translate to and from canonical parameter names.

Example::

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.1)
    >>> optimizer_state_by_name(opt, {"w": w})["param_groups"][0]["params"]
    ['w']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from varuna.runtime.checkpoint_files import CheckpointError

__all__ = ["optimizer_state_by_name", "load_optimizer_state_by_name", "merge_optimizer_states"]


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    named_params: Mapping[str, torch.Tensor],
    only: Iterable[str] | None = None,
) -> dict:
    """The optimizer's state with parameter names instead of torch's positional indices.

    Returns ``{"class": "AdamW", "state": {name: {key: value}}, "param_groups": [{hyper...,
    "params": [names]}]}``; with ``only``, just those parameters (groups without any of them are
    dropped). Values are references to the live tensors, like ``Optimizer.state_dict()``.
    State outside ``state[param]`` (entries of ``optimizer.state`` not keyed by a parameter, keys
    of ``state_dict()`` besides ``state`` and ``param_groups``: a global norm, a schedule-free
    optimizer's extras) is the stage's, under ``"stage_state"`` when there is any (Note
    [Registered state]'s sibling: the checkpointer saves it per stage, docs/checkpoints.md).

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    >>> w.grad = torch.ones(2); opt.step()
    >>> sd = optimizer_state_by_name(opt, {"w": w})
    >>> sorted(sd["state"]["w"]), sd["param_groups"][0]["params"], sd["param_groups"][0]["lr"]
    (['momentum_buffer'], ['w'], 0.1)
    """
    name_of = {id(p): n for n, p in named_params.items()}
    keep = None if only is None else set(only)
    sd = optimizer.state_dict()
    # state_dict() numbers parameters in the order of optimizer.param_groups: zip the two.
    index_to_name: dict[int, str] = {}
    for saved, live in zip(sd["param_groups"], optimizer.param_groups):
        for idx, p in zip(saved["params"], live["params"]):
            name = name_of.get(id(p))
            if name is None:
                raise ValueError(
                    "the optimizer holds a parameter that is not among the engine's parameters; build it "
                    "from the parameters the engine passes to the optimizer factory"
                )
            index_to_name[idx] = name
    groups = []
    for g in sd["param_groups"]:
        names = [index_to_name[i] for i in g["params"] if keep is None or index_to_name[i] in keep]
        if names:
            hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": names})
    state = {
        index_to_name[i]: dict(v)
        for i, v in sd["state"].items()
        if i in index_to_name and (keep is None or index_to_name[i] in keep)
    }
    out = {"class": type(optimizer).__name__, "state": state, "param_groups": groups}
    outside = {k: v for k, v in sd["state"].items() if k not in index_to_name}
    top = {k: v for k, v in sd.items() if k not in ("state", "param_groups")}
    if outside or top:
        out["stage_state"] = {"state": outside, "extra": top}
    return out


def merge_optimizer_states(parts: Iterable[dict]) -> dict:
    """Union of name-keyed optimizer states (e.g. read from several shard files)."""
    out: dict = {"class": None, "state": {}, "param_groups": []}
    for part in parts:
        if out["class"] is None:
            out["class"] = part.get("class")
        out["state"].update(part.get("state", {}))
        out["param_groups"].extend(part.get("param_groups", []))
    return out


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    named_params: Mapping[str, torch.Tensor],
    state: dict,
    *,
    copy: bool = True,
) -> None:
    """Load a name-keyed optimizer state (:func:`optimizer_state_by_name`) into ``optimizer``.

    The optimizer may hold its parameters in any order and grouping (another stage split): each
    parameter gets its own saved state, and each group the hyper-parameters saved with its
    parameters (they must agree within a group). Parameters without saved state start fresh,
    as they would after a first step. ``copy``: clone the state tensors (torch's own
    ``load_state_dict`` would alias them when dtype and device already match, so two optimizers
    loaded from one in-memory state would update the same buffers); False for freshly read files.

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.5)
    >>> load_optimizer_state_by_name(opt, {"w": w}, {"class": "SGD", "state": {},
    ...     "param_groups": [{"lr": 0.1, "momentum": 0.0, "dampening": 0, "weight_decay": 0,
    ...                       "nesterov": False, "maximize": False, "foreach": None,
    ...                       "differentiable": False, "fused": None, "params": ["w"]}]})
    >>> opt.param_groups[0]["lr"]
    0.1
    """
    cls = state.get("class")
    if cls is not None and cls != type(optimizer).__name__:
        raise CheckpointError(
            f"the checkpoint's optimizer state is for {cls} but the engine's optimizer is "
            f"{type(optimizer).__name__}; build the same optimizer as the run that saved it"
        )
    name_of = {id(p): n for n, p in named_params.items()}
    hyper_of: dict[str, dict] = {}
    for g in state.get("param_groups", []):
        hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        for n in g["params"]:
            hyper_of[n] = hyper
    saved_state = state.get("state", {})
    groups, by_index, idx = [], {}, 0
    for g in optimizer.param_groups:
        names = []
        for p in g["params"]:
            if id(p) not in name_of:
                raise ValueError("the optimizer holds a parameter that is not among the engine's parameters")
            names.append(name_of[id(p)])
        hypers = [hyper_of[n] for n in names if n in hyper_of]
        for h in hypers[1:]:
            if _plain_value(h) != _plain_value(hypers[0]):
                raise CheckpointError(
                    f"parameters {names[0]} and others of one optimizer group were saved with different "
                    "hyper-parameters; group parameters the way the saving run did"
                )
        current = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        saved = hypers[0] if hypers else {}
        groups.append({**current, **saved, "params": list(range(idx, idx + len(names)))})
        for i, n in enumerate(names):
            if n in saved_state:
                v = saved_state[n]
                by_index[idx + i] = {
                    k: (x.clone() if copy and isinstance(x, torch.Tensor) else x) for k, x in v.items()
                }
        idx += len(names)
    stage = state.get("stage_state") or {}
    outside = {k: v for k, v in stage.get("state", {}).items() if not isinstance(k, int)}
    optimizer.load_state_dict({**stage.get("extra", {}), "state": {**by_index, **outside},
                               "param_groups": groups})


def _plain_value(x: Any) -> Any:
    """Comparable plain-Python form of a hyper-parameter value (tensors become lists)."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _plain_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain_value(v) for v in x]
    return x
