"""Fitting the calibration's link and all-reduce models to measured points (used by the profiler).

Pure Python, no numpy, so the core stays light. The fits are robust to a busy machine (Note
[Robust fits]). Example::

    >>> pts = [LinkPoint(bytes=b, mean_s=1e-4 + b / 1e9, jitter_s=0.0) for b in (1000, 10**6)]
    >>> round(fit_link_model(pts).latency_s * 1e6)
    100

Note [Robust fits]: on a shared machine a measurement can be off by a descheduled thread (a few
ms) — more than a small message's whole time. So: repeated points of one message size are reduced
to their median; the link fit is a Theil–Sen regression (the bandwidth from the median of the
pairwise slopes between sizes, weighted by how far apart the sizes are; the latency from the
median residual, weighted towards the small messages that measure it); the all-reduce fit is an
iteratively reweighted least squares with Huber weights on relative residuals, so one stray point
cannot bend it. When the data still show no growth with message size, the fit does not fail: it
falls back to a documented conservative model (see ``fit_link_model``, ``fit_allreduce_model``)
and says so with a :class:`FitFallbackWarning` — a busy machine is not the user's error.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence

from varuna.core.calibration_sections import AllReduceModel, AllReducePoint, LinkModel, LinkPoint

__all__ = ["FitFallbackWarning", "fit_link_model", "fit_allreduce_model"]

#: Huber's tuning constant (95% efficiency on Gaussian noise).
_HUBER_K = 1.345
_IRLS_ROUNDS = 20


class FitFallbackWarning(UserWarning):
    """The measurements could not support a fit; a documented fallback model was used instead."""


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def _least_squares(rows: list[list[float]], y: list[float], weights: list[float]) -> list[float] | None:
    k = len(rows[0])
    ata = [[sum(w * r[i] * r[j] for r, w in zip(rows, weights)) for j in range(k)] for i in range(k)]
    aty = [sum(w * r[i] * t for r, t, w in zip(rows, y, weights)) for i in range(k)]
    return _solve(ata, aty)


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The value at half the total weight (the lower one on a tie).

    >>> _weighted_median([1.0, 2.0, 10.0], [1.0, 1.0, 1.0]), _weighted_median([1.0, 2.0, 10.0], [1, 1, 5])
    (2.0, 10.0)
    """
    pairs = sorted(zip(values, weights))
    half = sum(w for _, w in pairs) / 2
    acc = 0.0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0]


def _robust_least_squares(rows: list[list[float]], y: list[float]) -> list[float] | None:
    """Least squares on relative error with Huber weights, iterated (IRLS): points whose relative
    residual is far beyond the typical one (the median absolute residual) count less."""
    base = [1.0 / max(t, 1e-12) ** 2 for t in y]
    sol = _least_squares(rows, y, base)
    for _ in range(_IRLS_ROUNDS):
        if sol is None:
            return None
        rel = [(sum(c * x for c, x in zip(sol, r)) - t) / max(t, 1e-12) for r, t in zip(rows, y)]
        scale = statistics.median(abs(e) for e in rel) / 0.6745
        if scale <= 1e-12:  # (nearly) exact fit
            return sol
        cut = _HUBER_K * scale
        w = [b * (1.0 if abs(e) <= cut else cut / abs(e)) for b, e in zip(base, rel)]
        new = _least_squares(rows, y, w)
        if new is None or all(abs(a - b) <= 1e-12 * max(abs(a), 1e-300) for a, b in zip(new, sol)):
            return new if new is not None else sol
        sol = new
    return sol


def _size_medians(points: Sequence[LinkPoint]) -> list[tuple[float, float]]:
    """(bytes, median time) per distinct message size, by size."""
    by_size: dict[int, list[float]] = {}
    for p in points:
        by_size.setdefault(p.bytes, []).append(p.mean_s)
    return [(float(b), statistics.median(ts)) for b, ts in sorted(by_size.items())]


def fit_link_model(points: Sequence[LinkPoint]) -> LinkModel:
    """Fit ``mean_s = latency_s + bytes / bandwidth`` (Theil–Sen, Note [Robust fits]) to measurements.

    ``jitter_s`` of the model is the root-mean-square of the points' jitters. When the times do not
    grow with message size (the noise of a busy machine hides the bandwidth), falls back to a
    conservative model and warns (:class:`FitFallbackWarning`): latency = the median of the
    per-size times, bandwidth = the largest message's size over its time (as if all of it were
    transfer), so the model never predicts less than was measured.

    >>> pts = [LinkPoint(bytes=b, mean_s=1e-4 + b / 1e9, jitter_s=1e-5) for b in (1000, 10**6, 10**7)]
    >>> lm = fit_link_model(pts)
    >>> round(lm.latency_s * 1e6), round(lm.bandwidth_bytes_per_s / 1e9, 3)
    (100, 1.0)
    """
    pts = list(points)
    if len({p.bytes for p in pts}) < 2:
        raise ValueError("fitting a link model needs measurements at two or more message sizes")
    sizes = _size_medians(pts)
    slopes, spans = [], []
    for i, (xi, yi) in enumerate(sizes):
        for xj, yj in sizes[i + 1 :]:
            slopes.append((yj - yi) / (xj - xi))
            spans.append(xj - xi)  # far-apart sizes measure the bandwidth best
    inv_bw = _weighted_median(slopes, spans)
    jitter = math.sqrt(sum(p.jitter_s**2 for p in pts) / len(pts))
    if not inv_bw > 0:
        lat = statistics.median(y for _, y in sizes)
        x_max, y_max = sizes[-1]
        bw = x_max / max(y_max, 1e-12)
        warnings.warn(
            f"link measurements do not grow with message size (a busy machine?); using latency "
            f"{lat * 1e3:.3f} ms and the largest message's bandwidth {bw / 1e6:.1f} MB/s — re-run "
            "varuna-profile on a quieter machine or with more --link-reps for a real fit",
            FitFallbackWarning,
            stacklevel=2,
        )
        return LinkModel(latency_s=lat, bandwidth_bytes_per_s=bw, jitter_s=jitter, points=pts)
    # Latency: the median residual, weighted by relative precision (small messages measure it).
    lat = _weighted_median([y - inv_bw * x for x, y in sizes], [1.0 / max(y, 1e-12) ** 2 for _, y in sizes])
    return LinkModel(latency_s=max(lat, 0.0), bandwidth_bytes_per_s=1.0 / inv_bw, jitter_s=jitter, points=pts)


def _ar_medians(points: Sequence[AllReducePoint]) -> list[AllReducePoint]:
    """One point per (ring size, concurrency, bytes): the median time of its repeats."""
    groups: dict[tuple[int, int, int], list[AllReducePoint]] = {}
    for p in points:
        groups.setdefault((p.ring_size, p.concurrent, p.bytes), []).append(p)
    return [
        AllReducePoint(segment=g[0].segment, ring_size=d, concurrent=k, bytes=b,
                       time_s=statistics.median(p.time_s for p in g))
        for (d, k, b), g in sorted(groups.items())
    ]


def _grows(pts: Sequence[AllReducePoint]) -> bool:
    """Whether larger buffers take longer in most same-ring comparisons (True when none compare)."""
    up = down = 0
    for i, p in enumerate(pts):
        for q in pts[i + 1 :]:
            if (p.ring_size, p.concurrent) == (q.ring_size, q.concurrent) and p.bytes != q.bytes:
                slower = (q.time_s - p.time_s) * (q.bytes - p.bytes) > 0
                up, down = up + slower, down + (not slower)
    return up > down or up == down == 0


def _with_errors(model: AllReduceModel, pts: Sequence[AllReducePoint]) -> AllReduceModel:
    errs = [
        abs(model.time_s(p.bytes, p.ring_size, p.concurrent) - p.time_s) / max(p.time_s, 1e-12) for p in pts
    ]
    model.fit_rms_rel_error = math.sqrt(sum(e * e for e in errs) / len(errs))
    model.fit_max_rel_error = max(errs)
    return model


def fit_allreduce_model(points: Sequence[AllReducePoint]) -> AllReduceModel:
    """Fit the all-reduce model of Note [All-reduce model] (robust least squares, Note [Robust
    fits]) and report its error on the points.

    When the times do not grow with the buffer (in most comparisons of one ring size and
    concurrency) or no model with a positive bandwidth fits, falls back and warns
    (:class:`FitFallbackWarning`): contention 1, latency per ring step = the median of
    time/(ring_size − 1), bandwidth = the largest ring volume over its time — never less than was
    measured.

    >>> true = AllReduceModel(bandwidth_bytes_per_s=1e9, latency_s=1e-4, contention=0.5)
    >>> pts = [AllReducePoint(segment=None, ring_size=d, concurrent=k, bytes=b, time_s=true.time_s(b, d, k))
    ...        for d in (2, 4) for k in (1, 2) for b in (10**6, 10**8)]
    >>> fit = fit_allreduce_model(pts)
    >>> round(fit.bandwidth_bytes_per_s / 1e9, 3), round(fit.latency_s * 1e4, 3), round(fit.contention, 3)
    (1.0, 1.0, 0.5)
    """
    raw = [p for p in points if p.ring_size > 1]
    if len(raw) < 2:
        raise ValueError("fitting the all-reduce model needs two or more measurements with ring_size > 1")
    pts = _ar_medians(raw)
    y = [p.time_s for p in pts]
    x1 = [2.0 * (p.ring_size - 1) / p.ring_size * p.bytes for p in pts]
    xk = [x * (p.concurrent - 1) for x, p in zip(x1, pts)]
    xl = [float(p.ring_size - 1) for p in pts]
    has_k = any(v != 0 for v in xk)
    # Try the full model, then drop terms the data cannot support (singular) or that come out negative.
    attempts = [(has_k, True), (has_k, False), (False, True), (False, False)]
    if not _grows(pts):
        attempts = []
    for use_k, use_l in attempts:
        cols = [x1] + ([xk] if use_k else []) + ([xl] if use_l else [])
        if len(pts) < len(cols):
            continue
        sol = _robust_least_squares([list(r) for r in zip(*cols)], y)
        if sol is None or not sol[0] > 0 or any(not v >= 0 for v in sol[1:]):
            continue
        inv_bw = sol[0]
        c = sol[1] / inv_bw if use_k else 1.0
        lat = sol[-1] if use_l else 0.0
        return _with_errors(
            AllReduceModel(bandwidth_bytes_per_s=1.0 / inv_bw, latency_s=lat, contention=c, points=raw), pts
        )
    lat = statistics.median(t / (p.ring_size - 1) for t, p in zip(y, pts))
    j = max(range(len(pts)), key=lambda i: x1[i])
    bw = x1[j] / max(y[j], 1e-12)
    warnings.warn(
        f"all-reduce measurements do not grow with message size (a busy machine?); using latency "
        f"{lat * 1e3:.3f} ms per ring step and the largest buffer's bandwidth {bw / 1e6:.1f} MB/s — "
        "re-run varuna-profile on a quieter machine or with more --allreduce-reps for a real fit",
        FitFallbackWarning,
        stacklevel=2,
    )
    fallback = AllReduceModel(bandwidth_bytes_per_s=bw, latency_s=lat, contention=1.0, points=raw)
    return _with_errors(fallback, pts)
