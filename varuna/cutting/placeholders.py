"""Placeholders for modules whose calls fall outside a stage, and their bounded cache.

Note [Placeholders] in :mod:`varuna.cutting.split` says what a placeholder is: the zero tensors a
skipped module returns, shaped like its real output. This module finds those shapes by running
the module on ``meta`` tensors and caches them.

Note [Placeholder cache]: the shape of a module's output is a function of its inputs' *structure*,
not of their identity. Real models (Hugging Face transformers) pass per-call objects — a
``DynamicCache`` created inside the model's forward on every call, optional ``None`` inputs,
keyword flags — and a cache keyed on the objects themselves missed on every call, re-ran the module
on ``meta`` and kept every entry (and, through the key, every per-call cache object) forever:
2.5-10x slower steps and memory growing with the step count (issue #16). Now:

* The key is a *signature* of the call: for a tensor its shape, dtype and device; for ``None``,
  numbers, strings, dtypes, enums their type and value; for tuples, lists and dicts (``ModelOutput``
  too) the signatures of their items; for any other object its type and the signatures of its
  attributes (``__dict__`` / ``__slots__``), recursively — a ``DynamicCache`` is keyed by the shapes
  of the tensors it holds. Modules holding parameters or buffers are keyed by identity (they live as
  long as the model) and never copied; functions and classes by name. The module's ``training``
  flag and the autocast state are in the key (they may change the output's structure or dtype).
  The key holds no reference to a per-call object.
* A call too large to key (more than ``_MAX_ITEMS`` items, nested deeper than ``_MAX_DEPTH``) is
  computed on ``meta`` every time and not stored, with a one-time warning.
* Each skipped module keeps at most :data:`PLACEHOLDER_CACHE_SIZE` entries, least recently used out:
  memory stays flat whatever the inputs (varying sequence lengths, a smaller last micro-batch).
* The module runs on a *copy* of its arguments: tensors become ``meta`` tensors of the same shape,
  containers are rebuilt, and any other object (a ``DynamicCache``) is deep-copied with its tensors
  replaced by ``meta`` ones. Writing into the user's object is wrong — a ``Cache.update`` would put
  ``meta`` tensors into the user's cache, where real code may later read them. Passing ``None``
  instead of the object is wrong too: with past tokens in a cache, attention spans past + current
  keys and the mask is shaped for that, so the call could fail or give other shapes, and blocks that
  return the cache would return something else. A meta copy gives exactly the shapes the real call
  would give and leaves the user's object as it was. A skipped module's side effects on its
  arguments are therefore not replayed on other stages (the stage that owns the module does them);
  in training a cache is write-only, so nothing reads them.
* Outputs: tensors become zeros on the stage's device (as before); an output object that *is* one
  of the module's arguments (a block returning the cache it was given) is the caller's own object
  again, not the copy; ``None``, numbers and strings are returned as they were; any other object is
  returned as a fresh copy of what the ``meta`` run returned, tensors as zeros, so no two calls share
  a mutable object and no ``meta`` tensor reaches user code.
"""

from __future__ import annotations

import copy
import enum
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from varuna.cutting.cutpoint import SplitState

__all__ = ["PLACEHOLDER_CACHE_SIZE", "Skipper", "call_signature", "placeholder_cache_entries"]

#: entries kept per skipped module (least recently used out): a handful of distinct input shapes
#: (a smaller last micro-batch, a few sequence lengths) is the common case.
PLACEHOLDER_CACHE_SIZE = 16
#: a call whose arguments hold more items than this, or nest deeper, is not cached
_MAX_ITEMS = 4096
_MAX_DEPTH = 12

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
            torch.memory_format, enum.Enum, type(Ellipsis), range)
_NAMED = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType)


def _model_part(x: object) -> bool:
    """A module holding parameters or buffers: part of a model, lives as long as it, never copied.

    A module without any (transformers 4.4x's ``Cache`` subclassed ``nn.Module`` and kept its
    tensors in plain lists) is a per-call object like any other: keyed by structure and copied."""
    return isinstance(x, nn.Module) and (next(x.parameters(), None) is not None
                                         or next(x.buffers(), None) is not None)


class _Unkeyable(Exception):
    """The call's arguments are too large (or too deep) to key."""


class _Signer:
    """One walk over a call's arguments, producing a hashable structural signature."""

    def __init__(self) -> None:
        self.items = 0
        self.visited: dict[int, int] = {}  # id of a visited object -> its visit number (shared/cyclic refs)

    def sign(self, x: object, depth: int = 0) -> object:
        self.items += 1
        if self.items > _MAX_ITEMS or depth > _MAX_DEPTH:
            raise _Unkeyable
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.dtype, x.device)
        if isinstance(x, _SCALARS):
            return (type(x), x)
        if isinstance(x, (type, *_NAMED)):
            return ("name", getattr(x, "__module__", None), getattr(x, "__qualname__", repr(x)))
        if _model_part(x):  # lives as long as the model; its state does not shape outputs
            return ("module", id(x))
        seen = self.visited.get(id(x))
        if seen is not None:
            return ("ref", seen)
        self.visited[id(x)] = len(self.visited)
        if isinstance(x, (tuple, list)):
            return (type(x), tuple(self.sign(v, depth + 1) for v in x))
        if isinstance(x, dict):
            return (type(x), tuple((self.sign(k, depth + 1), self.sign(v, depth + 1)) for k, v in x.items()))
        state = _object_state(x)
        if state is None:  # opaque (a C object): its type is all there is to key on
            return ("opaque", type(x))
        return (type(x), tuple((k, self.sign(v, depth + 1)) for k, v in state.items()))


def _object_state(x: object) -> dict | None:
    """The attributes of ``x`` (``__dict__`` and ``__slots__``), or None for an opaque object."""
    state = dict(getattr(x, "__dict__", None) or {})
    for cls in type(x).__mro__:
        for s in getattr(cls, "__slots__", ()):
            if s not in ("__dict__", "__weakref__") and hasattr(x, s):
                state[s] = getattr(x, s)
    if not state and not hasattr(x, "__dict__"):
        return None
    return state


def call_signature(args: tuple, kwargs: dict) -> object | None:
    """The structural key of a call (Note [Placeholder cache]); None when it is too large to key.

    >>> import torch
    >>> a = call_signature((torch.zeros(2, 3),), {"mask": None})
    >>> a == call_signature((torch.ones(2, 3),), {"mask": None})
    True
    >>> call_signature((torch.zeros(2, 3),), {}) == call_signature((torch.zeros(2, 4),), {})
    False
    """
    try:
        return _Signer().sign((args, kwargs))
    except _Unkeyable:
        return None


def _tensors_in(obj: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through containers and object attributes."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
            continue
        if isinstance(x, (_SCALARS, type, *_NAMED)) or _model_part(x) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        else:
            stack.extend((_object_state(x) or {}).values())
    return out


def _copy_replacing_tensors(obj: object, new: Callable[[torch.Tensor], torch.Tensor]) -> object:
    """A deep copy of ``obj`` with each tensor ``t`` in it replaced by ``new(t)``; model parts are shared."""
    memo: dict[int, object] = {}
    for t in _tensors_in(obj):
        memo[id(t)] = new(t)
    stack, seen = [obj], set()
    while stack:  # modules (a model a cache points to) are shared, never copied
        x = stack.pop()
        if _model_part(x):
            memo[id(x)] = x
            continue
        if isinstance(x, (torch.Tensor, _SCALARS, type, *_NAMED)) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        else:
            stack.extend((_object_state(x) or {}).values())
    return copy.deepcopy(obj, memo)


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _is_plain(x: object) -> bool:
    """Passed to the meta run as it is (no copy): tensors are converted, the rest is immutable or
    part of the model."""
    return isinstance(x, (torch.Tensor, _SCALARS, type, *_NAMED)) or _model_part(x)


@dataclass(frozen=True)
class _Out:
    """How to rebuild one output leaf: zeros of ``shape``/``dtype``, the caller's argument ``arg``,
    the constant ``value``, or a fresh copy of ``template`` (an object, its tensors as zeros)."""

    kind: str  # "zeros" | "arg" | "const" | "object"
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    arg: int = -1
    value: object = None


class Skipper:
    """Replaces a module's forward: real compute inside the stage, placeholders outside
    (Note [Placeholders] in split.py, Note [Placeholder cache] here)."""

    def __init__(self, module: nn.Module, state: SplitState, device: torch.device, name: str = "") -> None:
        self.module, self.state, self.device, self.name = module, state, device, name
        self.orig = module.forward
        self.meta = {
            n: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
        }
        self.cache: OrderedDict[object, tuple[list[_Out], object]] = OrderedDict()
        self.max_entries = PLACEHOLDER_CACHE_SIZE
        self._warned = False

    def __call__(self, *args, **kwargs):
        state = self.state
        run = state.run
        if run is None or state.in_placeholder:
            return self.orig(*args, **kwargs)
        inside = run.in_stage()
        out = self.orig(*args, **kwargs) if inside else self.placeholder(args, kwargs)
        carry = getattr(run, "carry", None)  # Note [Carried values] in varuna/cutting/cutpoint.py
        if carry is not None:
            out = carry.module_output(self.name, out, computed=inside)
        return out

    def _key(self, args: tuple, kwargs: dict) -> object | None:
        dev = self.device.type
        autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) \
            if dev in ("cpu", "cuda") else None
        sig = call_signature(args, kwargs)
        if sig is None:
            return None
        key = (sig, self.module.training, autocast)
        try:
            hash(key)
        except TypeError:  # an unhashable value among the "scalars" (should not happen): do not cache
            return None
        return key

    def placeholder(self, args: tuple, kwargs: dict):
        """The module's output on this call with every tensor a zero placeholder."""
        key = self._key(args, kwargs)
        entry = self.cache.get(key) if key is not None else None
        if entry is None:
            entry = self._describe(args, kwargs)
            if key is not None:
                self.cache[key] = entry
                if len(self.cache) > self.max_entries:
                    self.cache.popitem(last=False)
            elif not self._warned:
                self._warned = True
                warnings.warn(f"varuna: the placeholder of module '{self.name}' cannot be cached (its "
                              f"arguments hold over {_MAX_ITEMS} items or nest deeper than {_MAX_DEPTH}); "
                              "every call outside its stage re-runs it on meta tensors", stacklevel=2)
        else:
            self.cache.move_to_end(key)
        descs, rspec = entry
        leaves = tree_flatten((args, kwargs))[0] if any(d.kind == "arg" for d in descs) else []
        return tree_unflatten([self._rebuild(d, leaves) for d in descs], rspec)

    def _rebuild(self, d: _Out, leaves: list) -> object:
        if d.kind == "zeros":
            return torch.zeros(d.shape, dtype=d.dtype, device=self.device)
        if d.kind == "arg":
            return leaves[d.arg]
        if d.kind == "const":
            return d.value
        return _copy_replacing_tensors(
            d.value, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=self.device))

    def _describe(self, args: tuple, kwargs: dict) -> tuple[list[_Out], object]:
        """Run the module on a meta copy of the call (Note [Placeholder cache]); describe its output."""
        leaves, spec = tree_flatten((args, kwargs))
        mleaves = [_to_meta(x) if isinstance(x, torch.Tensor) else
                   x if _is_plain(x) else _copy_replacing_tensors(x, _to_meta) for x in leaves]
        margs, mkwargs = tree_unflatten(mleaves, spec)
        self.state.in_placeholder = True
        try:
            res = torch.func.functional_call(self.module, self.meta, margs, mkwargs)
        finally:
            self.state.in_placeholder = False
        arg_of = {id(x): i for i, x in enumerate(mleaves) if not _is_plain(x)}
        rl, rspec = tree_flatten(res)
        descs = []
        for x in rl:
            if isinstance(x, torch.Tensor):
                descs.append(_Out("zeros", tuple(x.shape), x.dtype))
            elif id(x) in arg_of:
                descs.append(_Out("arg", arg=arg_of[id(x)]))
            elif _is_plain(x):
                descs.append(_Out("const", value=x))
            else:
                descs.append(_Out("object", value=x))
        return descs, rspec


def placeholder_cache_entries(model: nn.Module) -> int:
    """Placeholder shapes cached over all skipped modules of a materialised ``model`` (bounded by
    :data:`PLACEHOLDER_CACHE_SIZE` per module: Note [Placeholder cache])."""
    skippers = [m.__dict__.get("forward") for m in model.modules()]
    return sum(len(s.cache) for s in skippers if isinstance(s, Skipper))
