"""``varuna-checkpoint``: list, verify and export checkpoints, any registered format (issue 29).

Usage::

    varuna-checkpoint list ROOT                         # every step directory: step, format, P×D, size
    varuna-checkpoint verify PATH [PATH ...]            # a step directory, or a root: all its complete ones
    varuna-checkpoint export --to hf|dcp|varuna [--weights-only] SRC DST

``export`` converts SRC (a step directory, or a root: its newest complete checkpoint) into a new
directory DST in the named format, one file at a time (never the whole model in memory):
``--to hf`` gives a directory ``transformers``' ``from_pretrained`` loads (config.json included
when the model had one), ``--to dcp`` one ``torch.distributed.checkpoint.load`` reads. Without
``--weights-only`` the training state comes along (the result can be resumed from, like the
source); with it, only the weights (start from them with ``CheckpointConfig.init_from``).
``VARUNA_CHECKPOINT_FORMAT_MODULES`` names modules that register more formats.

Exit status: 0 done (``verify``: every checkpoint sound), 1 a checkpoint is unsound (``verify``) or
the conversion failed (one line), 2 bad usage (one line).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from varuna.core.cli import OneLineParser

__all__ = ["main"]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _list(root: Path) -> int:
    from varuna.runtime.checkpoint_registry import checkpoint_format
    from varuna.runtime.checkpoint_store import list_checkpoints

    infos = list_checkpoints(root)
    if not infos:
        print(f"{root}: no step directories")
        return 0
    print(f"{'step':>8}  {'format':8} {'complete':8} {'P×D':>6} {'MiB':>9}  path")
    for c in infos:
        layout = "-"
        if c.complete:
            try:
                _, meta = checkpoint_format(c.format).describe(c.path)
                cfg = meta.get("config", {})
                layout = f"{cfg.get('P', '?')}×{cfg.get('D', '?')}"
            except (ValueError, KeyError, OSError):
                layout = "?"
        print(f"{c.step:>8}  {c.format or '-':8} {'yes' if c.complete else 'no':8} {layout:>6} "
              f"{_size(c.path) / 2**20:>9.2f}  {c.path}")
    return 0


def _verify(paths: Sequence[Path]) -> int:
    from varuna.runtime.checkpoint_registry import format_of
    from varuna.runtime.checkpoint_store import list_checkpoints, verify_checkpoint

    bad = 0
    for path in paths:
        targets = [path] if format_of(path) is not None or not path.is_dir() else \
            [c.path for c in list_checkpoints(path) if c.complete] or [path]
        for t in targets:
            problems = verify_checkpoint(t)
            print(f"{t}: {'ok' if not problems else '; '.join(problems)}")
            bad += bool(problems)
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="varuna-checkpoint",
                           description="List, verify and export varuna checkpoints (any registered format).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    p_list = sub.add_parser("list", help="the step directories under a checkpoint root")
    p_list.add_argument("root", type=Path)
    p_verify = sub.add_parser("verify", help="check files against their sizes and checksums (no unpickling)")
    p_verify.add_argument("paths", type=Path, nargs="+", metavar="PATH")
    p_export = sub.add_parser("export", help="convert a checkpoint to another format")
    p_export.add_argument("--to", required=True, metavar="FORMAT", help="hf, dcp, varuna, ...")
    p_export.add_argument("--weights-only", action="store_true", help="leave the optimizer state out")
    p_export.add_argument("src", type=Path, help="a step directory, or a root (its newest)")
    p_export.add_argument("dst", type=Path, help="a new (or empty) directory")
    args = parser.parse_args(argv)
    from varuna.runtime.checkpoint_registry import format_names

    try:
        names = format_names()
    except ValueError as e:  # a module of $VARUNA_CHECKPOINT_FORMAT_MODULES does not import
        parser.error(str(e))
    if args.command == "list":
        if not args.root.is_dir():
            parser.error(f"{args.root} is not a directory")
        return _list(args.root)
    if args.command == "verify":
        missing = [str(p) for p in args.paths if not p.exists()]
        if missing:
            parser.error(f"{missing[0]} does not exist")
        return _verify(args.paths)
    if args.to not in names:
        parser.error(f"unknown format {args.to!r}; registered: {', '.join(names)}")
    if not args.src.is_dir():
        parser.error(f"{args.src} is not a directory")
    from varuna.core.extras import MissingExtra
    from varuna.runtime.checkpoint_convert import export_checkpoint

    try:
        step_dir = export_checkpoint(args.src, args.dst, to=args.to, weights_only=args.weights_only)
    except MissingExtra as e:
        parser.error(str(e))
    except (ValueError, OSError) as e:  # CheckpointError included: one line, exit 1
        print(f"varuna-checkpoint: export failed: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(f"exported {step_dir} to {args.dst} ({args.to}{', weights only' if args.weights_only else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
