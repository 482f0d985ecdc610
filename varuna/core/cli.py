"""What every varuna command line shares: usage errors are one line and exit 2; the auto-config
options (:func:`add_planning_args`) have one spelling, one unit and one help text in every CLI
that plans (``varuna-launch``, ``varuna-simulate``); a renamed option keeps its old spelling for a
release (:func:`add_deprecated_alias`).

    >>> parser = OneLineParser(prog="varuna-demo")
    >>> _ = parser.add_argument("--steps", type=int)
    >>> parser.parse_args(["--steps", "3"]).steps
    3
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from varuna.core.selective_recompute import parse_segment_set

__all__ = ["EXIT_USAGE", "OneLineParser", "add_deprecated_alias", "add_planning_args", "parse_size",
           "positive_int", "segment_set"]

#: Exit status of a command-line usage error (argparse's own convention).
EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line naming the command and
    pointing at ``--help`` (the contract of every varuna CLI), instead of the usage block."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes of a size given in bytes or with a unit (``17179869184``, ``16GiB``, ``16G`` = 16e9):
    the one spelling of a memory size on every command line.

    Example::

        >>> parse_size("16GiB"), parse_size("1.5k")
        (17179869184, 1500)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; give bytes, e.g. 17179869184 or 16GiB")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; give a size > 0, e.g. 16GiB")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse ``type``; one-line usage error otherwise).

    Example::

        >>> positive_int("4")
        4
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def segment_set(text: str) -> tuple[int, ...]:
    """A recompute set, ``0,2-3`` or ``none`` (argparse ``type``; one-line usage error otherwise:
    ``varuna.core.selective_recompute.parse_segment_set``).

    Example::

        >>> segment_set("0,2-3")
        (0, 2, 3)
    """
    try:
        return parse_segment_set(text, "invalid value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_planning_args(
    parser: argparse.ArgumentParser,
    *,
    title: str = "auto-config (plan P×D, m and the stage split from a calibration)",
    schedules: Sequence[str] | None = None,
    require_global_batch: bool = False,
) -> argparse._ArgumentGroup:
    """Add the auto-config options every planning CLI shares, as one group: ``--calibration``,
    ``--global-batch-size``, ``--schedule``, ``--chunks``, ``--micro-batch-size``,
    ``--gpu-memory SIZE`` (and ``--gpu-memory-gib``, deprecated), ``--recompute-segments SET``.
    Unset options are None (the schedule too: the caller's default applies), so a plan records
    only what the user stated.
    ``schedules``: the accepted kinds (default: any, checked by the planner); the parsed options
    become a :class:`varuna.core.planning.PlanRequest` with ``PlanRequest.from_args``.

    Example::

        >>> p = OneLineParser(prog="demo")
        >>> _ = add_planning_args(p)
        >>> a = p.parse_args(["--global-batch-size", "32", "--gpu-memory", "16GiB"])
        >>> a.global_batch_size, a.gpu_memory, a.schedule
        (32, 17179869184, None)
    """
    group = parser.add_argument_group(title)
    group.add_argument("--calibration", default=None, metavar="FILE",
                       help="calibration JSON from varuna-profile: the costs auto-config plans with")
    group.add_argument("--global-batch-size", type=positive_int, default=None, required=require_global_batch,
                       metavar="M", help="examples per mini-batch (optimizer step) to plan for; the workers "
                       "get it in their run plan (VARUNA_GLOBAL_BATCH_SIZE)")
    group.add_argument("--schedule", default=None, choices=list(schedules) if schedules else None,
                       metavar="KIND" if not schedules else None,
                       help="pipeline schedule kind to plan for (default varuna); the workers get it in "
                       "their run plan (VARUNA_SCHEDULE)")
    # int, not positive_int: the planners name a bad count with its fix (chunks_problem, PlanRequest).
    group.add_argument("--chunks", type=int, default=None, metavar="V",
                       help="model chunks per process for the interleaved kinds (interleaved, "
                       "varuna-interleaved; V >= 2, the model then needs P·V - 1 cut-points; VARUNA_CHUNKS)")
    group.add_argument("--micro-batch-size", type=positive_int, default=None, metavar="m",
                       help="fix the micro-batch size instead of letting auto-config choose it "
                       "(VARUNA_MICRO_BATCH_SIZE)")
    group.add_argument("--gpu-memory", type=parse_size, default=None, metavar="SIZE",
                       help="memory per accelerator, in bytes or with a unit (17179869184, 16GiB)")
    add_deprecated_alias(group, "--gpu-memory-gib", "--gpu-memory", dest="gpu_memory", metavar="GIB",
                         convert=lambda text: int(float(text) * 2**30), example=lambda v: f"{v // 2**30}GiB"
                         if v % 2**30 == 0 else str(v))
    group.add_argument("--recompute-segments", type=segment_set, default=None, metavar="SET",
                       help="selective recompute: the segments a recomputed micro-batch recomputes, the "
                       "others keep their activations (0,2-3; none: keep every activation; default: whole "
                       "stages, or what auto-config chooses for --gpu-memory; VARUNA_RECOMPUTE_SEGMENTS)")
    return group


def add_deprecated_alias(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    old: str,
    new: str,
    *,
    dest: str,
    metavar: str | None = None,
    convert: Callable[[str], Any] = str,
    example: Callable[[Any], str] = str,
) -> None:
    """Accept the old spelling ``old`` of option ``new`` for a release: it sets ``dest`` (through
    ``convert``) and prints one line on stderr naming the new spelling (``example`` writes the value
    as ``new`` takes it).

    Example::

        >>> p = OneLineParser(prog="demo")
        >>> _ = p.add_argument("--procs-per-host", type=int, dest="procs_per_host")
        >>> add_deprecated_alias(p, "--hosts-slots", "--procs-per-host", dest="procs_per_host", convert=int)
        >>> p.parse_args(["--hosts-slots", "4"]).procs_per_host  # doctest: +SKIP
        demo: warning: --hosts-slots is deprecated; use --procs-per-host 4
        4
    """

    class _Deprecated(argparse.Action):
        def __call__(self, p: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            try:
                value = convert(values)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                p.error(f"argument {old}: invalid value {values!r}; use {new}")
            print(f"{p.prog}: warning: {old} is deprecated; use {new} {example(value)}", file=sys.stderr)
            setattr(namespace, dest, value)

    parser.add_argument(old, action=_Deprecated, dest=dest, metavar=metavar, default=argparse.SUPPRESS,
                        help=f"deprecated spelling of {new}")
