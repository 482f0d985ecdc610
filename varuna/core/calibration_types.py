"""VM types in a calibration file (schema version 2; issue #19, mixed VM types in one job).

Part of :mod:`varuna.core.calibration` (which re-exports :class:`VmType` and
:class:`SegmentCompute`). A job's pool may mix VM types; one calibration file then holds the base
measurements (the top-level ``segments``: the host that was profiled) and a ``types`` object, one
entry per VM type::

    "types": {
      "fast": {"speed": 1.6, "memory_bytes": 17179869184, "device": "A100"},
      "slow": {"segments": [{"fwd_s": [...], "recompute_s": [...], "bwd_s": [...]}, ...]}
    }

A type gives either its own per-segment compute (``segments``: F, R and B per measured
micro-batch size, parallel to the base's ``micro_batch_sizes``) or only a relative ``speed``
(its compute is the base's divided by it), or both (its own costs win; ``speed`` is then a note).
Sizes (parameters, activations), links, the all-reduce and the optimizer are the base's: the
model and the network are one. ``memory_bytes``: what one accelerator of the type holds (None:
unknown, not checked). Pure Python: no torch.

Example::

    >>> t = VmType(name="fast", speed=1.6)
    >>> VmType.from_dict("fast", t.to_dict(), num_segments=2, num_sizes=1) == t
    True
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from varuna.core.calibration_sections import REPROFILE_FIX, ComputeStat, FieldReader

__all__ = ["SegmentCompute", "VmType", "check_type_name", "for_type", "with_types"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_type_name(name: Any) -> str | None:
    """Why ``name`` cannot name a VM type (one line with the fix), or None.

    >>> check_type_name("a b")  # doctest: +ELLIPSIS
    "VM type name 'a b' must be 1-64 letters, digits, '_', '.' or '-' (starting with a letter or ..."
    """
    if isinstance(name, str) and _NAME.fullmatch(name):
        return None
    return (
        f"VM type name {name!r} must be 1-64 letters, digits, '_', '.' or '-' (starting with a letter "
        "or digit), e.g. 'Standard_NC6'"
    )


@dataclass(kw_only=True, frozen=True)
class SegmentCompute:
    """One segment's compute on one VM type: F, R and B per measured micro-batch size."""

    fwd_s: tuple[ComputeStat, ...]
    recompute_s: tuple[ComputeStat, ...]
    bwd_s: tuple[ComputeStat, ...]

    def to_dict(self) -> dict:
        return {
            "fwd_s": [s.to_dict() for s in self.fwd_s],
            "recompute_s": [s.to_dict() for s in self.recompute_s],
            "bwd_s": [s.to_dict() for s in self.bwd_s],
        }

    @classmethod
    def _read(cls, r: FieldReader, obj: Any, path: str, n: int) -> SegmentCompute:
        def stats(key: str) -> tuple[ComputeStat, ...]:
            values = r.get(obj, key, path, "list")
            if len(values) != n:
                raise r.fail(
                    f"field '{path}.{key}' has {len(values)} entries but micro_batch_sizes has {n} — "
                    f"{REPROFILE_FIX}"
                )
            return tuple(ComputeStat._read(r, v, f"{path}.{key}[{j}]") for j, v in enumerate(values))

        return cls(fwd_s=stats("fwd_s"), recompute_s=stats("recompute_s"), bwd_s=stats("bwd_s"))


@dataclass(kw_only=True, frozen=True)
class VmType:
    """A VM type of a calibration: its name and its compute (own ``segments``, or the base's
    divided by ``speed``), and its accelerator memory."""

    name: str
    speed: float | None = None
    """Relative throughput against the base measurements (1.6: 1.6× faster); None with ``segments``."""
    memory_bytes: int | None = None
    """Memory of one accelerator of this type (None: not known, not checked)."""
    device: str | None = None
    """Free text, e.g. the accelerator's name."""
    segments: tuple[SegmentCompute, ...] | None = None
    """Own per-segment compute (one per model segment), else None."""
    price_per_hour: float | None = None
    """What one accelerator of this type costs per hour (any currency; None: unknown), for
    ``varuna-simulate --cluster``'s cost to train."""

    def __post_init__(self) -> None:
        problem = check_type_name(self.name)
        if problem is not None:
            raise ValueError(problem)
        if self.speed is None and self.segments is None:
            raise ValueError(
                f"VM type {self.name!r} needs a relative 'speed' or its own per-segment 'segments' costs"
            )
        if self.speed is not None and not (0 < self.speed < math.inf):
            raise ValueError(f"VM type {self.name!r}: speed must be finite and > 0, got {self.speed}")
        if self.segments is not None:
            object.__setattr__(self, "segments", tuple(self.segments))
        if self.price_per_hour is not None and not (0 <= self.price_per_hour < math.inf):
            raise ValueError(
                f"VM type {self.name!r}: price_per_hour must be finite and >= 0, got {self.price_per_hour}"
            )

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        if self.speed is not None:
            out["speed"] = self.speed
        if self.memory_bytes is not None:
            out["memory_bytes"] = self.memory_bytes
        if self.device is not None:
            out["device"] = self.device
        if self.segments is not None:
            out["segments"] = [s.to_dict() for s in self.segments]
        if self.price_per_hour is not None:
            out["price_per_hour"] = self.price_per_hour
        return out

    @classmethod
    def from_dict(
        cls, name: str, obj: Any, *, num_segments: int, num_sizes: int, source: str = "calibration"
    ) -> VmType:
        """Validate one entry of ``types`` (``ValueError``: one line naming the field and the fix)."""
        return cls._read(FieldReader(source), name, obj, num_segments, num_sizes)

    @classmethod
    def _read(cls, r: FieldReader, name: str, obj: Any, num_segments: int, n: int) -> VmType:
        path = f"types.{name}"
        problem = check_type_name(name)
        if problem is not None:
            raise r.fail(f"{problem} (in 'types')")
        if not isinstance(obj, dict):
            raise r.fail(f"field '{path}' must be an object — {REPROFILE_FIX}")
        speed = r.check(obj.get("speed"), f"{path}.speed", "num", optional=True)
        memory = r.check(obj.get("memory_bytes"), f"{path}.memory_bytes", "int", optional=True)
        device = r.check(obj.get("device"), f"{path}.device", "str", optional=True)
        segs = r.check(obj.get("segments"), f"{path}.segments", "list", optional=True)
        price = r.check(obj.get("price_per_hour"), f"{path}.price_per_hour", "num", optional=True)
        if price is not None and price < 0:
            raise r.fail(
                f"field '{path}.price_per_hour' must be >= 0, got {price} — give the price of one VM-hour"
            )
        if speed is None and segs is None:
            raise r.fail(
                f"VM type '{name}' has neither 'speed' nor 'segments' — give its relative speed or "
                f"profile it (varuna-profile on a VM of that type)"
            )
        if speed is not None and speed <= 0:
            raise r.fail(f"field '{path}.speed' must be > 0, got {speed} — give its relative throughput")
        if segs is not None and len(segs) != num_segments:
            raise r.fail(
                f"field '{path}.segments' has {len(segs)} entries but model.num_segments is "
                f"{num_segments} — {REPROFILE_FIX}"
            )
        return cls(
            name=name,
            speed=None if speed is None else float(speed),
            memory_bytes=memory,
            device=device,
            price_per_hour=None if price is None else float(price),
            segments=None
            if segs is None
            else tuple(SegmentCompute._read(r, s, f"{path}.segments[{i}]", n) for i, s in enumerate(segs)),
        )


# ---------------------------------------------------------------------------------------------
# Calibration.for_type / with_types (here to keep the Calibration class small; ``base`` is a
# varuna.core.calibration.Calibration, which imports this module)


def for_type(base: Any, name: str) -> Any:
    """This calibration as measured on VM type ``name``: its segments' F, R and B are the
    type's own, or the base's divided by its speed; everything else is the base's; no types.

    >>> from varuna.core.calibration import Calibration
    >>> cal = Calibration.synthetic(0.01, num_segments=2, micro_batch_sizes=(1,))
    >>> cal.types["fast"] = VmType(name="fast", speed=2.0)
    >>> round(cal.for_type("fast").fwd_s(0, 1), 6)
    0.005
    """
    t = base.types.get(name)
    if t is None:
        have = ", ".join(sorted(base.types)) or "none"
        raise ValueError(
            f"{base.source} has no VM type {name!r} (its types: {have}); add it to the file's "
            f"'types' section (docs/calibration.md) or profile a VM of that type"
        )
    if t.segments is not None and len(t.segments) != base.num_segments:
        raise ValueError(
            f"VM type {name!r} has {len(t.segments)} segment costs but the model has "
            f"{base.num_segments} segments — {REPROFILE_FIX}"
        )
    segs = []
    for i, s in enumerate(base.segments):
        if t.segments is not None:
            own = t.segments[i]
            f, r, b = list(own.fwd_s), list(own.recompute_s), list(own.bwd_s)
        else:
            f, r, b = (_scaled(x, 1.0 / float(t.speed)) for x in (s.fwd_s, s.recompute_s, s.bwd_s))
        segs.append(dataclasses.replace(s, fwd_s=f, recompute_s=r, bwd_s=b))
    host = dataclasses.replace(base.host, device=t.device or f"{base.host.device} [{name}]")
    return dataclasses.replace(
        base, segments=segs, host=host, types={}, source=f"{base.source} [type {name}]"
    )


def with_types(
    base: Any, per_type: dict[str, Any], *, memory_bytes: dict[str, int] | None = None
) -> Any:
    """A copy whose ``types`` hold each calibration of ``per_type`` (one file per VM type, e.g.
    one profiling run on the first VM of each type) as a type with its own segment costs; all
    must be of this model at these micro-batch sizes.

    >>> from varuna.core.calibration import Calibration
    >>> base = Calibration.synthetic(0.01, num_segments=2, micro_batch_sizes=(1,))
    >>> slow = Calibration.synthetic(0.02, num_segments=2, micro_batch_sizes=(1,))
    >>> round(base.with_types({"slow": slow}).for_type("slow").bwd_s(1, 1), 6)
    0.04
    """
    types = dict(base.types)
    for name, other in per_type.items():
        other.check_model(base.model.cutpoint_names, source=other.source)
        if list(other.micro_batch_sizes) != list(base.micro_batch_sizes):
            raise ValueError(
                f"{other.source} (type {name!r}) measured micro-batch sizes {other.micro_batch_sizes} but "
                f"{base.source} has {base.micro_batch_sizes}; profile both at the same sizes "
                f"(varuna-profile --micro-batch-sizes)"
            )
        types[name] = VmType(
            name=name,
            memory_bytes=(memory_bytes or {}).get(name),
            device=other.host.device,
            segments=tuple(
                SegmentCompute(
                    fwd_s=tuple(s.fwd_s), recompute_s=tuple(s.recompute_s), bwd_s=tuple(s.bwd_s)
                )
                for s in other.segments
            ),
        )
    return dataclasses.replace(base, types=types, version=max(base.version, 2))



def _scaled(stats: Any, factor: float) -> list[ComputeStat]:
    return [ComputeStat(median=x.median * factor, spread=x.spread * factor) for x in stats]
