"""The calibration being built: measurements merged into what a calibration file holds, then fitted.

:class:`CalibrationState` holds every measured quantity keyed by (segment or cut-point, m) or as
points, so a new run's measurements merge into an existing file's (``varuna-profile --update``:
:func:`state_from_file`). :func:`assemble` turns it into a
:class:`~varuna.core.calibration.Calibration` plus the profiler's diagnostics (fits and their
errors): F/B/R linear in m per segment (:func:`fit_linear`), the link and all-reduce models
(:mod:`varuna.core.calibration_fit`).

Example::

    >>> fit = fit_linear([1, 2, 4], [0.011, 0.021, 0.041])
    >>> round(fit["intercept_s"], 4), round(fit["per_example_s"], 4)
    (0.001, 0.01)
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from profiler.compute import SegmentMeasurement, median_iqr
from varuna.core.calibration import (
    AllReduceModel,
    AllReducePoint,
    Calibration,
    ComputeStat,
    CutPointCalibration,
    HostInfo,
    LinkModel,
    LinkPoint,
    ModelInfo,
    SegmentCalibration,
    SendStat,
    SharedParams,
)
from varuna.core.calibration_fit import FitFallbackWarning, fit_allreduce_model, fit_link_model

__all__ = ["CalibrationState", "add_compute", "assemble", "fit_linear", "state_from_file"]


def fit_linear(ms: Sequence[float], ys: Sequence[float]) -> dict:
    """Least-squares ``y = intercept + slope·m`` (relative weights) and its errors on the points.

    One point: a line through the origin. Negative intercepts are clamped to 0 (a cost).

    >>> fit = fit_linear([1, 2, 4], [0.011, 0.021, 0.041])
    >>> round(fit["intercept_s"], 4), round(fit["per_example_s"], 4), fit["max_rel_error"] < 1e-9
    (0.001, 0.01, True)
    """
    pts = [(float(m), float(y)) for m, y in zip(ms, ys)]
    if len(pts) == 1 or len({m for m, _ in pts}) == 1:
        a, b = 0.0, pts[0][1] / pts[0][0]
    else:
        w = [1.0 / max(y, 1e-12) ** 2 for _, y in pts]
        sw, sm, sy = (
            sum(w),
            sum(wi * m for wi, (m, _) in zip(w, pts)),
            sum(wi * y for wi, (_, y) in zip(w, pts)),
        )
        smm = sum(wi * m * m for wi, (m, _) in zip(w, pts))
        smy = sum(wi * m * y for wi, (m, y) in zip(w, pts))
        det = sw * smm - sm * sm
        b = (sw * smy - sm * sy) / det
        a = (sy - b * sm) / sw
        if a < 0:
            a, b = 0.0, smy / smm
    errs = [abs(a + b * m - y) / max(y, 1e-12) for m, y in pts]
    return {
        "intercept_s": a,
        "per_example_s": b,
        "max_rel_error": max(errs),
        "rms_rel_error": math.sqrt(sum(e * e for e in errs) / len(errs)),
    }


def _link_fit_errors(model: LinkModel) -> dict:
    errs = [abs(model.time_s(p.bytes) - p.mean_s) / max(p.mean_s, 1e-12) for p in model.points]
    return {
        "rms_rel_error": math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else 0.0,
        "max_rel_error": max(errs, default=0.0),
    }




def _fit_network(st: CalibrationState) -> tuple[dict[str, LinkModel], AllReduceModel, list[str]]:
    """The link and all-reduce models, and the fallbacks taken (Note [Robust fits] in
    varuna/core/calibration_fit.py), each also printed as one warning line on stderr: a busy
    machine gives a usable, conservative file and says so, never an error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FitFallbackWarning)
        try:
            links = {kind: fit_link_model(st.link_points[kind]) for kind in ("intra", "inter")}
            allreduce = fit_allreduce_model(st.ar_points)
        except ValueError as e:  # too few sizes/rings measured: the plan, not the noise
            raise RuntimeError(
                f"cannot fit the network models ({e}); measure more sizes "
                "(ProfileOptions.link_sweep_bytes, allreduce_sweep_bytes)"
            ) from e
    notes = [str(w.message) for w in caught if issubclass(w.category, FitFallbackWarning)]
    for note in notes:
        print(f"varuna-profile: warning: {note}", file=sys.stderr, flush=True)
    return links, allreduce, notes


# ---------------------------------------------------------------------------------------------
# Collected state (per m / per point), from a measurement or from an existing file


@dataclass
class CalibrationState:
    """Everything a calibration file holds, keyed so that new measurements merge in."""

    cutpoint_names: list[str]
    num_segments: int
    seg_static: dict[int, dict] = field(default_factory=dict)
    """segment -> param_bytes, grad_bytes, optimizer_bytes, optimizer_step_s."""
    seg_at: dict[tuple[int, int], dict] = field(default_factory=dict)
    """(segment, m) -> fwd/bwd/recompute ComputeStat, stashed_input_bytes, activation_bytes, peak_bytes."""
    act_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    """(cut-point, m) -> bytes."""
    sends: dict[tuple[str, int, int], SendStat] = field(default_factory=dict)
    """(act_send_intra_s | ..., cut-point, m) -> SendStat."""
    link_points: dict[str, list[LinkPoint]] = field(default_factory=lambda: {"intra": [], "inter": []})
    ar_points: list[AllReducePoint] = field(default_factory=list)
    memory_source: str = "saved_tensors"
    fwd_flops_per_example: list[float] | None = None
    """Each segment's forward FLOPs per example (``model.fwd_flops_per_example``)."""
    shared_params: list[SharedParams] = field(default_factory=list)
    """Parameters several segments read (``model.shared_params``)."""


def state_from_file(cal: Calibration, extra: Mapping[str, Any]) -> CalibrationState:
    st = CalibrationState(cutpoint_names=list(cal.model.cutpoint_names), num_segments=cal.num_segments,
                          fwd_flops_per_example=cal.model.fwd_flops_per_example,
                          shared_params=list(cal.model.shared_params))
    ex_segs = extra.get("segments") or []
    for i, seg in enumerate(cal.segments):
        ex = ex_segs[i] if i < len(ex_segs) else {}
        st.seg_static[i] = {
            "param_bytes": seg.param_bytes,
            "grad_bytes": seg.grad_bytes,
            "optimizer_bytes": seg.optimizer_bytes,
            "optimizer_step_s": ex.get("optimizer_step_s", 0.0),
        }
        peaks = ex.get("peak_bytes") or []
        for j, m in enumerate(cal.micro_batch_sizes):
            st.seg_at[(i, m)] = {
                "fwd_s": seg.fwd_s[j],
                "bwd_s": seg.bwd_s[j],
                "recompute_s": seg.recompute_s[j],
                "stashed_input_bytes": seg.stashed_input_bytes[j],
                "activation_bytes": seg.activation_bytes[j],
                "peak_bytes": peaks[j] if j < len(peaks) else None,
            }
    for c, cut in enumerate(cal.cutpoints):
        for j, m in enumerate(cal.micro_batch_sizes):
            st.act_bytes[(c, m)] = cut.act_bytes[j]
            for kind in CutPointCalibration._SENDS:
                values = getattr(cut, kind)
                if values is not None:
                    st.sends[(kind, c, m)] = values[j]
    st.link_points = {"intra": list(cal.intra.points), "inter": list(cal.inter.points)}
    st.ar_points = list(cal.allreduce.points)
    st.memory_source = extra.get("memory_source", st.memory_source)
    return st


def add_compute(st: CalibrationState, meas: Sequence[SegmentMeasurement]) -> None:
    for r in meas:
        med = {
            k: ComputeStat(median=a, spread=b)
            for k, (a, b) in (
                ("fwd_s", median_iqr(r.fwd_s)),
                ("bwd_s", median_iqr(r.bwd_s)),
                ("recompute_s", median_iqr(r.recompute_s)),
            )
        }
        peak = r.param_bytes + r.grad_bytes + r.optimizer_bytes + r.stashed_input_bytes + r.activation_bytes
        st.seg_at[(r.segment, r.micro_batch_size)] = {
            **med,
            "stashed_input_bytes": r.stashed_input_bytes,
            "activation_bytes": r.activation_bytes,
            "peak_bytes": peak,
        }
        prev = st.seg_static.get(r.segment, {}).get("optimizer_step_s_all", [])
        st.seg_static[r.segment] = {
            "param_bytes": r.param_bytes,
            "grad_bytes": r.grad_bytes,
            "optimizer_bytes": r.optimizer_bytes,
            "optimizer_step_s_all": prev + list(r.optimizer_step_s),
        }
        st.seg_static[r.segment]["optimizer_step_s"] = median_iqr(
            st.seg_static[r.segment]["optimizer_step_s_all"]
        )[0]
        st.memory_source = r.memory_source


def _ms_of(st: CalibrationState) -> list[int]:
    return sorted({m for (_, m) in st.seg_at})


def assemble(st: CalibrationState, *, created: str, host: HostInfo, model_name: str
             ) -> tuple[Calibration, dict]:
    """The calibration (and its diagnostics, also set as ``cal.profiler``) of everything in ``st``."""
    ms = _ms_of(st)
    segments, extra_segs, compute_fit = [], [], []
    for i in range(st.num_segments):
        at = [st.seg_at[(i, m)] for m in ms]
        static = st.seg_static[i]
        segments.append(
            SegmentCalibration(
                fwd_s=[a["fwd_s"] for a in at],
                bwd_s=[a["bwd_s"] for a in at],
                recompute_s=[a["recompute_s"] for a in at],
                param_bytes=int(static["param_bytes"]),
                grad_bytes=int(static["grad_bytes"]),
                optimizer_bytes=int(static["optimizer_bytes"]),
                stashed_input_bytes=[int(a["stashed_input_bytes"]) for a in at],
                activation_bytes=[int(a["activation_bytes"]) for a in at],
            )
        )
        peaks = [a.get("peak_bytes") for a in at]
        extra_segs.append({"peak_bytes": peaks, "optimizer_step_s": static.get("optimizer_step_s", 0.0)})
        compute_fit.append(
            {k: fit_linear(ms, [a[k].median for a in at]) for k in ("fwd_s", "bwd_s", "recompute_s")}
        )
    cutpoints = []
    for c, name in enumerate(st.cutpoint_names):
        sends = {}
        for kind in CutPointCalibration._SENDS:
            vals = [st.sends.get((kind, c, m)) for m in ms]
            sends[kind] = None if any(v is None for v in vals) else vals
        cutpoints.append(
            CutPointCalibration(name=name, act_bytes=[st.act_bytes[(c, m)] for m in ms], **sends)
        )
    links, allreduce, fit_warnings = _fit_network(st)
    total_opt_s = sum(s.get("optimizer_step_s", 0.0) for s in st.seg_static.values())
    total_param = sum(s["param_bytes"] for s in st.seg_static.values() if s.get("grad_bytes"))
    cal = Calibration(
        created=created,
        model=ModelInfo(
            name=model_name, cutpoint_names=list(st.cutpoint_names), num_segments=st.num_segments,
            fwd_flops_per_example=st.fwd_flops_per_example, shared_params=list(st.shared_params),
        ),
        host=host,
        micro_batch_sizes=ms,
        segments=segments,
        cutpoints=cutpoints,
        intra=links["intra"],
        inter=links["inter"],
        allreduce=allreduce,
        optimizer_s_per_param_byte=total_opt_s / total_param if total_param else 0.0,
    )
    extra = {
        "segments": extra_segs,
        "compute_fit": compute_fit,
        "memory_source": st.memory_source,
        "link_fit": {kind: _link_fit_errors(links[kind]) for kind in links},
        "fit_warnings": fit_warnings,
        "allreduce_configs": [list(c) for c in sorted({(p.ring_size, p.concurrent) for p in st.ar_points})],
    }
    cal.profiler = extra  # the same object: what calibrate() adds to extra lands in the file
    return cal, extra
