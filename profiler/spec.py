"""What to profile: a model annotated with CutPoints, named by a ``module_or_file:factory`` spec.

A *factory* is a function that returns ``(model, make_batch)`` or ``(model, make_batch, loss_fn)``:

- ``model``: an ``nn.Module`` with ``varuna.CutPoint``\\ s called in its forward (on CPU);
- ``make_batch(m)``: one micro-batch of ``m`` examples, in the form ``Engine.train_step`` takes
  (a tensor, a tuple/list of positional arguments, or a dict of keyword arguments) — or such a
  batch itself (the ``(model, example_batch)`` factories of ``varuna-trace``): then micro-batches
  are its first m examples, repeated cyclically when m exceeds its size;
- ``loss_fn(output, batch)`` (optional): the scalar mean loss; default: the model returns it.

The spec names the factory as ``package.module:function`` (imported) or ``path/to/file.py:function``
(loaded from the file, with the file's directory put on ``sys.path`` so its sibling imports work).
Keyword arguments reach the factory from ``--model-arg KEY=VALUE`` (VALUE parsed as JSON when it
can be, else taken as a string).

Example::

    >>> target = load_target("profiler.targets:emulated", {"num_blocks": 3, "fwd_s": 0.0})
    >>> type(target.model).__name__, tuple(target.make_batch(2)[0].shape)
    ('EmulatedModel', (2, 16))
    >>> parse_model_args(["width=64", "name=big", "dims=[1, 2]"])
    {'width': 64, 'name': 'big', 'dims': [1, 2]}
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelTarget", "load_target", "parse_model_args", "parse_micro_batch_sizes", "spec_of_callable"]


@dataclass(kw_only=True)
class ModelTarget:
    """A built model ready to profile."""

    spec: str
    """The ``module_or_file:factory`` string it was built from (how workers rebuild it)."""
    kwargs: dict[str, Any]
    """Keyword arguments given to the factory."""
    model: Any
    """The ``nn.Module`` (annotated with CutPoints)."""
    make_batch: Callable[[int], Any]
    """``make_batch(m)``: one micro-batch of m examples."""
    loss_fn: Callable[[Any, Any], Any]
    """``loss_fn(output, batch)``: the scalar loss."""


def _model_returns_loss(output: Any, batch: Any) -> Any:
    import torch

    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    raise ValueError(
        "the model's forward must return a scalar loss, or the factory must return "
        "(model, make_batch, loss_fn) with loss_fn(output, batch) -> scalar"
    )


def spec_of_callable(factory: Callable) -> str:
    """The ``module:qualname`` spec of an importable function (so worker processes can rebuild it).

    >>> spec_of_callable(parse_model_args)
    'profiler.spec:parse_model_args'
    """
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError(
            f"cannot hand {factory!r} to worker processes: pass a 'module:function' or 'file.py:function' "
            "spec string naming a module-level factory"
        )
    return f"{module}:{name}"


def _load_factory(spec: str) -> Callable:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(
            f"bad model spec {spec!r}: expected module_or_file:factory, e.g. "
            "examples/gpt2/profile_target.py:build or mypkg.models:build"
        )
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"bad model spec {spec!r}: file {where} does not exist")
        # The file's directory goes first on sys.path: example scripts import their siblings
        # (examples/gpt2/profile_target.py does `from model import GPT`).
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        mod_name = f"_varuna_profile_target_{abs(hash(str(path)))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"bad model spec {spec!r}: cannot load {where} as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"model spec {spec!r}: importing {where} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ValueError(
                f"model spec {spec!r}: cannot import module {where}: {type(e).__name__}: {e}"
            ) from e
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"model spec {spec!r}: {where} has no attribute {name!r}")
    if not callable(obj):
        raise ValueError(f"model spec {spec!r}: {name} is not callable")
    return obj


def load_target(spec: str | Callable, kwargs: Mapping[str, Any] | None = None) -> ModelTarget:
    """Import the factory named by ``spec`` (or take the callable), call it, check what it returns.

    Raises ``ValueError`` with a one-line message on any problem (the CLI exits 2 with it).
    """
    from torch import nn

    if callable(spec):
        factory, spec = spec, spec_of_callable(spec)
    else:
        factory = _load_factory(spec)
    kw = dict(kwargs or {})
    try:
        made = factory(**kw)
    except Exception as e:
        raise ValueError(f"model spec {spec!r}: the factory raised {type(e).__name__}: {e}") from e
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise ValueError(
            f"model spec {spec!r}: the factory must return (model, make_batch) or "
            "(model, make_batch, loss_fn), "
            f"got {type(made).__name__}"
        )
    model, make_batch = made[0], made[1]
    if not callable(make_batch):
        make_batch = _resizer(make_batch, spec)
    loss_fn = made[2] if len(made) == 3 and made[2] is not None else _model_returns_loss
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model spec {spec!r}: the factory's first result must be an nn.Module, got "
            f"{type(model).__name__}"
        )
    if not callable(make_batch) or not callable(loss_fn):
        raise ValueError(f"model spec {spec!r}: make_batch and loss_fn must be callables")
    return ModelTarget(spec=spec, kwargs=kw, model=model, make_batch=make_batch, loss_fn=loss_fn)


def _resizer(batch: Any, spec: str) -> Callable[[int], Any]:
    """``make_batch(m)`` from one example batch: its first m examples, cycled when m is larger.

    >>> import torch
    >>> make = _resizer((torch.arange(3), "x"), "demo")
    >>> make(2)[0].tolist(), make(5)[0].tolist(), make(5)[1]
    ([0, 1], [0, 1, 2, 0, 1], 'x')
    """
    import torch
    from torch.utils._pytree import tree_map

    from varuna.cutting.batches import batch_size_of

    try:
        size = batch_size_of(batch)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"model spec {spec!r}: the factory's second result is neither make_batch(m) nor a "
            f"batch of tensors with a common first dimension ({e})"
        ) from e

    def make_batch(m: int) -> Any:
        index = torch.arange(m) % size
        return tree_map(lambda x: x[index] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, batch)

    return make_batch


def parse_model_args(items: Sequence[str] | None) -> dict[str, Any]:
    """``["k=v", ...]`` to a dict; values are JSON when they parse, else strings."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"bad --model-arg {item!r}: expected KEY=VALUE with a Python identifier as KEY")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def parse_micro_batch_sizes(text: str | Sequence[int]) -> list[int]:
    """``"1,2,4"`` (or a list) to a sorted list of distinct positive integers.

    >>> parse_micro_batch_sizes("4, 1,2,2")
    [1, 2, 4]
    >>> parse_micro_batch_sizes("1,x")
    Traceback (most recent call last):
    ValueError: bad micro-batch size list '1,x': expected positive integers separated by commas, e.g. 1,2,4
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        try:
            m = int(str(item).strip())
        except ValueError:
            m = 0
        if m < 1 or (isinstance(item, float) and not float(item).is_integer()):
            raise ValueError(
                f"bad micro-batch size list {text!r}: expected positive integers separated by commas, "
                "e.g. 1,2,4"
            )
        out.append(m)
    if not out:
        raise ValueError(
            "empty micro-batch size list: give at least one size, e.g. --micro-batch-sizes 1,2,4"
        )
    return sorted(set(out))
