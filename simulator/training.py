"""What a predicted throughput means for a whole training run: TFLOP/s per device (and MFU), time
and cost to train a number of steps or tokens (``varuna-simulate --train-steps/--train-tokens``).

FLOPs come from the calibration (``model.fwd_flops_per_example``: the profiler's count of each
segment's forward, Note [Model FLOPs] in varuna/core/flops.py: a training example costs 3 of
them); the same definition as the engine's ``StepResult.tflops``, so a prediction and a run can be
compared. Pure Python (no torch).

Example::

    >>> est = estimate_training(examples_per_s=100.0, devices=8, global_batch_size=64,
    ...                         flops_per_example=6e12, train_steps=1000, device_price_per_hour=2.0)
    >>> round(est.tflops_per_device, 1), round(est.hours, 3), round(est.cost, 2)
    (75.0, 0.178, 2.84)
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import asdict, dataclass

from varuna.core.calibration import Calibration
from varuna.core.flops import PRECISION_NAMES, peak_tflops

__all__ = ["TrainingEstimate", "add_training_args", "device_peak_of", "estimate_training",
           "flops_per_example", "parse_count", "parse_prices"]

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """A count like ``300B``, ``2.5e9`` or ``1_000`` (K, M, B/G, T: powers of 1000).

    >>> parse_count("300B"), parse_count("2.5e9")
    (300000000000.0, 2500000000.0)
    """
    m = re.fullmatch(r"\s*([0-9_]*\.?[0-9_]+(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}; give a number, e.g. 300B or 3e11")
    value = float(m.group(1).replace("_", "")) * _SUFFIX[m.group(2).lower()]
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}; it must be > 0")
    return value


def parse_prices(text: str) -> dict[str, float] | float:
    """``2.5`` (every device) or ``fast=3.1,slow=1.2`` (per VM type): prices of one device-hour.

    >>> parse_prices("fast=3.1,slow=1.2"), parse_prices("2.5")
    ({'fast': 3.1, 'slow': 1.2}, 2.5)
    """
    def price(v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            x = -1.0
        if not 0 <= x < math.inf:
            raise argparse.ArgumentTypeError(
                f"invalid price {v!r} in {text!r}; give a number >= 0, or TYPE=PRICE,... per VM type")
        return x

    if "=" not in text:
        return price(text.strip())
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if not name.strip():
            raise argparse.ArgumentTypeError(
                f"invalid prices {text!r}; write TYPE=PRICE,..., e.g. fast=3.1,slow=1.2")
        out[name.strip()] = price(value.strip())
    return out


def add_training_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of a training-run estimate to ``p`` (one group of ``varuna-simulate``'s
    parser); returns ``p``."""
    g = p.add_argument_group("time and cost to train (docs/simulator.md)")
    steps = g.add_mutually_exclusive_group()
    steps.add_argument("--train-steps", type=parse_count, metavar="N", help="optimizer steps to train")
    steps.add_argument("--train-tokens", type=parse_count, metavar="T", help="tokens to train, e.g. 300B")
    g.add_argument("--tokens-per-example", type=int, metavar="L",
                   help="tokens in one example (its sequence length), with --train-tokens")
    g.add_argument("--price-per-device-hour", type=parse_prices, metavar="PRICE",
                   help="price of one device-hour, or TYPE=PRICE,... with --cluster (else the calibration's "
                        "types' price_per_hour)")
    g.add_argument("--peak-tflops", type=float, metavar="X",
                   help="dense peak TFLOP/s of one device, for MFU (else the table of known GPUs by the "
                        "calibration's device, at --precision)")
    g.add_argument("--precision", choices=PRECISION_NAMES, help="the run's math, for the peak from the table")
    return p


@dataclass(frozen=True)
class TrainingEstimate:
    """A configuration's predicted rate, per device, and what a training run at it takes."""

    devices: int
    examples_per_s: float
    tflops_per_device: float | None
    """Model TFLOP/s per device (None: the calibration counted no FLOPs)."""
    peak_tflops: float | None
    mfu: float | None
    steps: int | None
    hours: float | None
    cost: float | None
    """Price of those hours on all the devices (None: no price given)."""

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for the terminal."""
        parts = [f"{self.tflops_per_device:.3g} TFLOP/s per device" if self.tflops_per_device is not None
                 else "TFLOP/s unknown (the calibration has no FLOP count: re-run varuna-profile)"]
        if self.mfu is not None:
            parts.append(f"MFU {self.mfu:.1%} of {self.peak_tflops:g}")
        if self.steps is not None and self.hours is not None:
            parts.append(f"{self.steps:,} steps in {self.hours:,.2f} h on {self.devices} devices")
        if self.cost is not None:
            parts.append(f"cost {self.cost:,.2f}")
        return "predicted: " + "; ".join(parts)


def flops_per_example(cal: Calibration) -> float | None:
    """Model FLOPs of training one example (3 × the forward's), from the calibration; None when
    it carries no count."""
    f = cal.model.fwd_flops_per_example
    return None if not f else 3.0 * sum(f)


def estimate_training(
    *,
    examples_per_s: float,
    devices: int,
    global_batch_size: int,
    flops_per_example: float | None,
    peak: float | None = None,
    train_steps: float | None = None,
    train_tokens: float | None = None,
    tokens_per_example: int | None = None,
    device_price_per_hour: float | None = None,
    price_per_hour: float | None = None,
) -> TrainingEstimate:
    """The :class:`TrainingEstimate` of ``devices`` processing ``examples_per_s``. Steps are
    ``train_steps``, or ``train_tokens`` over (global batch × ``tokens_per_example``), rounded up.
    Cost: ``price_per_hour`` for the whole set of devices, else ``device_price_per_hour`` each."""
    if train_tokens is not None and not tokens_per_example:
        raise ValueError("--train-tokens needs --tokens-per-example (the sequence length of one example)")
    tflops = None if flops_per_example is None else examples_per_s * flops_per_example / devices / 1e12
    steps = None
    if train_steps is not None:
        steps = math.ceil(train_steps)
    elif train_tokens is not None:
        steps = math.ceil(train_tokens / (global_batch_size * tokens_per_example))
    hours = None
    if steps is not None and examples_per_s > 0:
        hours = steps * global_batch_size / examples_per_s / 3600
    rate = price_per_hour if price_per_hour is not None else (
        None if device_price_per_hour is None else device_price_per_hour * devices)
    return TrainingEstimate(
        devices=devices, examples_per_s=examples_per_s, tflops_per_device=tflops, peak_tflops=peak,
        mfu=None if tflops is None or not peak else tflops / peak, steps=steps, hours=hours,
        cost=None if hours is None or rate is None else hours * rate,
    )


def device_peak_of(cal: Calibration, peak: float | None, precision: str | None) -> float | None:
    """``peak`` if given, else the table's peak for the calibration's device at ``precision``."""
    if peak is not None:
        if not 0 < peak < math.inf:
            raise ValueError(f"--peak-tflops must be a number > 0, got {peak}")
        return peak
    return None if precision is None else peak_tflops(cal.host.device, precision)
