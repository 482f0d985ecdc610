"""``varuna-trace``: print what crosses segment boundaries in a model (see :mod:`varuna.cutting.tracer`).

Usage::

    varuna-trace TARGET [--cut-after PATTERNS | --cuts K [--cost flop|time]] [--arg KEY=VALUE ...]
                 [--json PATH|-]

``TARGET`` names a factory: ``path/to/file.py:FACTORY`` or ``package.module:FACTORY``
(``:FACTORY`` defaults to ``build``). The factory takes no arguments (or the ``--arg`` ones) and
returns ``(model, example_batch)``, ``(model, example_batch, loss_fn)`` or a dict with those
keys; ``example_batch`` is one micro-batch as the model's forward takes it. Examples::

    varuna-trace examples/resnet/model.py:build --cuts 3
    varuna-trace my_gpt.py --json report.json

``--cut-after PATTERNS`` first cuts after the modules the names/patterns select (as
``varuna-launch --cut-after``); ``--cuts K`` first inserts up to K automatic cut-points (for a model
without CutPoints; balancing FLOPs, like the engine, unless ``--cost time``) and prints the plan.
``--json PATH`` also writes the machine-readable report (``-``: print only the JSON).

Exit status: 0 when the model can be split at its CutPoints, 1 when it cannot (hidden
dependencies, no valid boundary for ``--cuts``, or what the engine refuses: no CutPoint at all, a
forward that returns no scalar loss and no ``loss_fn`` — one line on stderr), 2 on bad usage (one
line on stderr).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from varuna.core.cli import OneLineParser

__all__ = ["main", "load_target"]


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit status 2."""


def _parse_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise UsageError(f"--arg expects KEY=VALUE with KEY a Python name, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_target(target: str, kwargs: dict | None = None) -> tuple:
    """Import ``FILE.py[:FACTORY]`` or ``MODULE[:FACTORY]``, call the factory, return
    ``(model, example_batch, loss_fn)``.

    >>> model, batch, loss_fn = load_target("examples/resnet/model.py:build", {"batch_size": 2})
    >>> type(model).__name__, loss_fn is None
    ('ResNet', True)
    """
    spec, _, factory_name = target.rpartition(":") if ":" in target else (target, "", "build")
    if not spec or not factory_name:
        raise UsageError(f"target {target!r} must look like path/to/file.py:FACTORY or "
                         "package.module:FACTORY")
    if spec.endswith(".py") or "/" in spec or Path(spec).is_file():
        path = Path(spec)
        if not path.is_file():
            raise UsageError(f"no such file: {spec}")
        sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
        name = f"_varuna_trace_{path.stem}"
        mspec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mspec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            mspec.loader.exec_module(module)
        except Exception as e:  # e.g. a file that is not UTF-8 text: one line naming it, no traceback
            raise UsageError(f"importing {spec} failed: {type(e).__name__}: {_first_line(e)}") from None
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as e:
            raise UsageError(f"cannot import {spec!r}: {e}") from None
        except Exception as e:
            raise UsageError(f"cannot import {spec!r}: {type(e).__name__}: {_first_line(e)}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UsageError(f"{spec} has no callable {factory_name!r}; name the factory: {spec}:FACTORY")
    try:
        made = factory(**(kwargs or {}))
    except TypeError as e:
        raise UsageError(f"calling {factory_name}(): {e}") from None
    if isinstance(made, dict):
        made = (made.get("model"), made.get("example_batch"), made.get("loss_fn"))
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise UsageError(f"{factory_name}() must return (model, example_batch) or "
                         "(model, example_batch, loss_fn)")
    import torch.nn as nn

    model, batch, loss_fn = (*made, None)[:3]
    if not isinstance(model, nn.Module):
        raise UsageError(f"{factory_name}() returned a {type(model).__name__} as the model, not an nn.Module")
    return model, batch, loss_fn


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="varuna-trace",
        description="Dry-run a model and report tied weights, values read across segments and hidden "
                    "dependencies that would break a pipeline split.",
    )
    parser.add_argument("target", help="FILE.py[:FACTORY] or MODULE[:FACTORY]; FACTORY (default: build) "
                                       "returns (model, example_batch[, loss_fn])")
    parser.add_argument("--cut-after", metavar="PATTERNS",
                        help="first cut after the modules these comma-separated names/patterns select "
                             "(e.g. 'model.layers.*')")
    parser.add_argument("--cuts", type=int, metavar="K", help="first insert up to K automatic cut-points")
    parser.add_argument("--cost", choices=("flop", "time"), default="flop",
                        help="what --cuts balances: FLOPs (default, as the engine) or measured forward time")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the factory (Python literal or string); repeatable")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the report as JSON ('-': print only the JSON)")
    args = parser.parse_args(argv)
    try:
        if args.cuts is not None and args.cuts < 1:
            raise UsageError(f"--cuts must be >= 1, got {args.cuts}")
        if args.cuts is not None and args.cut_after is not None:
            raise UsageError("--cut-after and --cuts both given: cut by name or automatically, not both")
        kwargs = dict(_parse_arg(a) for a in args.arg)
        model, batch, loss_fn = load_target(args.target, kwargs)
    except UsageError as e:
        parser.error(str(e))  # exits 2 with one line on stderr
    from varuna.cutting.autocut import auto_cutpoints
    from varuna.cutting.routing import apply_cutpoints
    from varuna.cutting.tracer import trace_for_engine

    quiet = args.json == "-"
    try:
        if args.cut_after is not None:
            apply_cutpoints(model, args.cut_after)
        if args.cuts is not None:
            plan = auto_cutpoints(model, batch, args.cuts, loss_fn, cost=args.cost, verbose=False)
            if not quiet:
                print(plan, end="\n\n")
        report, refusals = trace_for_engine(model, batch, loss_fn)
    except ValueError as e:  # about the model, not the command line
        print(f"varuna-trace: {e}", file=sys.stderr)
        return 1
    if refusals:  # what the engine would refuse: one line, never a table that looks fine
        print(f"varuna-trace: {refusals[0]}", file=sys.stderr)
        return 1
    if quiet:
        print(report.to_json())
    else:
        print(report.table())
        if args.json:
            Path(args.json).write_text(report.to_json() + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
