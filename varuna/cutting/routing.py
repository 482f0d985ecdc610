"""Routing a module's output through a CutPoint, without editing the model: cut-points placed
by module name or pattern (:func:`apply_cutpoints`, ``VarunaConfig.cut_after``,
``varuna-launch --cut-after``), and the same insertion for automatic cut-points
(:mod:`varuna.cutting.autocut`).

The chosen module gets a ``CutPoint`` child named ``varuna_cut``, and its class is swapped for a
subclass (same name) whose ``__call__`` routes the output through it *after* the module's own
hooks: every tensor of the output (a tensor, or the tensors of a tuple, list, dict or
``ModelOutput``) crosses the cut, so the engine's dry run sees the module as a whole inside one
segment and other stages skip it. Parameter names do not change (checkpoints keep their keys);
:func:`remove_cutpoints` undoes it.

    >>> import torch
    >>> m = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 1))
    >>> match_modules(m, "1.*")
    ['1.0', '1.1']
    >>> [type(c).__name__ for c in apply_cutpoints(m, "1.*")]
    ['CutPoint', 'CutPoint']
    >>> remove_cutpoints(m)
    ['1.0', '1.1']
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from varuna.core.config_error import ConfigError
from varuna.cutting.cutpoint import CutPoint

__all__ = ["CUT_ATTR", "apply_cutpoints", "match_modules", "remove_cutpoints", "check_no_cutpoints",
           "insert_cutpoints", "routed_modules"]

#: name of the CutPoint child added to a chosen module
CUT_ATTR = "varuna_cut"
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


# ---------------------------------------------------------------------------------------------
# Inserting and removing cut-points


def _route(cut: CutPoint, out):
    """``cut`` applied to a module output: the tensor itself, or every tensor in a tuple, list, dict
    or ``ModelOutput`` (anything torch's pytree flattens), rebuilt around what the cut returns.

    Every tensor, not only the first: a block's other outputs may be read by the next block (T5's
    blocks return the position bias the first one computed, and every later one reads it), and a
    value passed through the cut reaches the next stage with its gradient going back. Non-tensor
    items (None, a cache object) stay as they are.
    """
    if isinstance(out, torch.Tensor):
        return cut(out)
    leaves, spec = tree_flatten(out)
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if not at:
        raise TypeError(f"a module with an automatic cut-point returned a {type(out).__name__}; it must "
                        "return a tensor, or a tuple/list/dict/ModelOutput holding tensors")
    crossed = cut(*(leaves[i] for i in at))
    for i, x in zip(at, crossed if len(at) > 1 else (crossed,)):
        leaves[i] = x
    return tree_unflatten(leaves, spec)


_ROUTED: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """A subclass of ``cls`` (same name) whose calls end by routing the output through the CutPoint."""
    if getattr(cls, "_varuna_routed_base", None) is not None:
        return cls
    sub = _ROUTED.get(cls)
    if sub is None:
        def __call__(self, *args, **kwargs):
            out = super(sub, self).__call__(*args, **kwargs)
            return _route(self._modules[CUT_ATTR], out)

        def __reduce_ex__(self, protocol):
            # The generated class cannot be found by name: pickle (torch.save, deepcopy) rebuilds it.
            return _rebuild_routed, (cls,), self.__getstate__()

        sub = type(cls.__name__, (cls,), {
            "__call__": __call__, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "_varuna_routed_base": cls,
        })
        _ROUTED[cls] = sub
    return sub


def _rebuild_routed(base: type) -> nn.Module:
    """Unpickling helper: an empty instance of the routed subclass of ``base`` (state comes next)."""
    obj = base.__new__(base)
    obj.__class__ = _routed_class(base)
    return obj


def match_modules(model: nn.Module, patterns: str | Sequence[str]) -> list[str]:
    """Names of the submodules of ``model`` that ``patterns`` select, in ``named_modules()`` order.

    A pattern is a dotted module name whose parts may hold shell wildcards (``*``, ``?``,
    ``[0-3]``); each part matches one level of the name, so ``transformer.h.*`` selects the
    blocks ``transformer.h.0``, ``transformer.h.1``, ... and not their submodules. A plain name
    selects that module. Patterns may be given as one comma-separated string. Raises
    ``ValueError`` (one line, with the closest names) when a pattern selects nothing.

    >>> m = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))
    >>> match_modules(m, "*")
    ['0', '1', '2']
    >>> match_modules(m, ["1.*", "2"])
    ['1.0', '1.1', '2']
    """
    from fnmatch import fnmatchcase

    pats = _split_patterns(patterns)
    names = [n for n, _ in model.named_modules() if n]
    parts = {n: n.split(".") for n in names}
    picked: dict[str, None] = {}
    for pat in pats:
        pp = pat.split(".")
        hits = [n for n in names if len(parts[n]) == len(pp) and all(map(fnmatchcase, parts[n], pp))]
        if not hits:
            raise ConfigError(f"cut-point pattern {pat!r} matches no module of the model"
                             f"{_closest(pat, names)}; patterns are dotted names from model.named_modules(), "
                             "'*' matching one level (e.g. 'transformer.h.*')")
        picked.update(dict.fromkeys(hits))
    order = {n: i for i, n in enumerate(names)}
    return sorted(picked, key=order.__getitem__)


def _split_patterns(patterns: str | Sequence[str]) -> list[str]:
    items = [patterns] if isinstance(patterns, str) else list(patterns)
    if not all(isinstance(x, str) for x in items):
        raise ValueError(f"cut-point names must be strings, got {patterns!r}")
    pats = [q.strip() for x in items for q in x.split(",") if q.strip()]
    if not pats:
        raise ValueError("no cut-point names given; pass module names or patterns such as 'model.layers.*'")
    return pats


def _closest(pat: str, names: list[str]) -> str:
    import difflib

    # Compare like with like: names with as many levels as the pattern, wildcards as a digit.
    depth = pat.count(".")
    pool = [n for n in names if n.count(".") == depth] or names
    near = difflib.get_close_matches(pat.replace("*", "0").replace("?", "0"), pool, n=3, cutoff=0.4)
    return f" (closest: {', '.join(near)})" if near else ""


def apply_cutpoints(model: nn.Module, module_names: str | Sequence[str]) -> list[CutPoint]:
    """Route the output of each selected module through a new CutPoint (see the module docstring).

    ``module_names``: module names or patterns (:func:`match_modules`: ``"model.layers.*"``
    selects every decoder layer). Returns the CutPoints in ``named_modules()`` order. Parameter
    and buffer names do not change, so checkpoints and ``state_dict`` keys stay the same.

    >>> import torch
    >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> [type(c).__name__ for c in apply_cutpoints(m, ["1"])]
    ['CutPoint']
    >>> remove_cutpoints(m)
    ['1']
    """
    return insert_cutpoints(model, match_modules(model, module_names), auto=False)


def insert_cutpoints(model: nn.Module, names: list[str], *, auto: bool) -> list[CutPoint]:
    modules = dict(model.named_modules())
    for name in names:
        mod = modules.get(name)
        if mod is None or mod is model:
            raise ValueError(f"no submodule named {name!r} in the model; give names from "
                             "model.named_modules()")
        if isinstance(mod, nn.Sequential):
            last = next(reversed(mod._modules), "?")
            raise ValueError(f"{name!r} is a Sequential, which cannot host a cut-point; cut after its last "
                             f"module instead: '{name}.{last}'")
        if isinstance(mod, _CONTAINERS):
            raise ValueError(f"{name!r} is a {type(mod).__name__}, never called as a whole; cut after each "
                             f"of its modules instead: '{name}.*'")
        if CUT_ATTR in mod._modules:
            raise ValueError(f"module {name!r} already has a cut-point (apply_cutpoints or cut_after ran "
                             "twice on this model?); place each cut-point once")
    out = []
    for name in names:
        mod = modules[name]
        cp = CutPoint()
        # Who placed it: planned cut-points are replaced by a new plan, by-name ones never are;
        # both are routed (Note [Carried values] in varuna/cutting/cutpoint.py).
        cp.planned = auto
        cp.routed = True
        mod.add_module(CUT_ATTR, cp)
        mod.__class__ = _routed_class(type(mod))
        out.append(cp)
    return out


def remove_cutpoints(model: nn.Module, *, only_auto: bool = False) -> list[str]:
    """Undo :func:`apply_cutpoints` (and automatic cut-points); returns the names of the modules
    that had a cut-point. ``only_auto``: keep the ones placed by name."""
    names = []
    for name, mod in list(model.named_modules()):
        base = getattr(type(mod), "_varuna_routed_base", None)
        if base is not None and (not only_auto or _is_auto(mod._modules[CUT_ATTR])):
            mod.__class__ = base
            del mod._modules[CUT_ATTR]
            names.append(name)
    return names


def routed_modules(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if getattr(type(m), "_varuna_routed_base", None) is not None]


def check_no_cutpoints(model: nn.Module) -> None:
    """Raise ``ValueError`` (one line) if ``model`` has CutPoints other than automatic ones: placed
    by hand or by name (``apply_cutpoints``, ``cut_after``), they cannot be mixed with automatic ones."""
    own = [n for n, m in model.named_modules() if isinstance(m, CutPoint) and not _is_auto(m)]
    if own:
        more = ", ..." if len(own) > 3 else ""
        raise ValueError(f"the model already has {len(own)} CutPoint(s) placed by hand or by name "
                         f"({', '.join(own[:3])}{more}); automatic cut-points cannot be mixed with them: "
                         "drop auto_cutpoints (--auto-cutpoints) or the manual cut-points")


def _is_auto(cp: nn.Module) -> bool:
    return getattr(cp, "planned", False)
