"""Fitting the calibration's link and all-reduce models to measured points (used by the profiler).

Pure least squares, no numpy, so the core stays light. Example::

    >>> pts = [LinkPoint(bytes=b, mean_s=1e-4 + b / 1e9, jitter_s=0.0) for b in (1000, 10**6)]
    >>> round(fit_link_model(pts).latency_s * 1e6)
    100
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from varuna.core.calibration_sections import AllReduceModel, AllReducePoint, LinkModel, LinkPoint

__all__ = ["fit_link_model", "fit_allreduce_model"]



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


def fit_link_model(points: Sequence[LinkPoint]) -> LinkModel:
    """Fit ``mean_s = latency_s + bytes / bandwidth`` (relative least squares) to measurements.

    ``jitter_s`` of the model is the root-mean-square of the points' jitters.

    >>> pts = [LinkPoint(bytes=b, mean_s=1e-4 + b / 1e9, jitter_s=1e-5) for b in (1000, 10**6, 10**7)]
    >>> lm = fit_link_model(pts)
    >>> round(lm.latency_s * 1e6), round(lm.bandwidth_bytes_per_s / 1e9, 3)
    (100, 1.0)
    """
    pts = list(points)
    if len({p.bytes for p in pts}) < 2:
        raise ValueError("fitting a link model needs measurements at two or more message sizes")
    # Relative weighting (1/t²) so small messages (latency) and large ones (bandwidth) both count.
    w = [1.0 / max(p.mean_s, 1e-12) ** 2 for p in pts]
    sol = _least_squares([[1.0, float(p.bytes)] for p in pts], [p.mean_s for p in pts], w)
    if sol is None or sol[1] <= 0:
        raise ValueError("link measurements do not grow with message size; cannot fit a bandwidth")
    lat, inv_bw = sol
    if lat < 0:  # refit through the origin: latency cannot be negative
        lat = 0.0
        num = sum(wi * p.bytes * p.mean_s for p, wi in zip(pts, w))
        inv_bw = num / sum(wi * p.bytes**2 for p, wi in zip(pts, w))
    jitter = math.sqrt(sum(p.jitter_s**2 for p in pts) / len(pts))
    return LinkModel(latency_s=lat, bandwidth_bytes_per_s=1.0 / inv_bw, jitter_s=jitter, points=pts)


def fit_allreduce_model(points: Sequence[AllReducePoint]) -> AllReduceModel:
    """Fit the all-reduce model of Note [All-reduce model] and report its error on the points.

    >>> true = AllReduceModel(bandwidth_bytes_per_s=1e9, latency_s=1e-4, contention=0.5)
    >>> pts = [AllReducePoint(segment=None, ring_size=d, concurrent=k, bytes=b, time_s=true.time_s(b, d, k))
    ...        for d in (2, 4) for k in (1, 2) for b in (10**6, 10**8)]
    >>> fit = fit_allreduce_model(pts)
    >>> round(fit.bandwidth_bytes_per_s / 1e9, 3), round(fit.latency_s * 1e4, 3), round(fit.contention, 3)
    (1.0, 1.0, 0.5)
    """
    pts = [p for p in points if p.ring_size > 1]
    if len(pts) < 2:
        raise ValueError("fitting the all-reduce model needs two or more measurements with ring_size > 1")
    y = [p.time_s for p in pts]
    w = [1.0 / max(t, 1e-12) ** 2 for t in y]
    x1 = [2.0 * (p.ring_size - 1) / p.ring_size * p.bytes for p in pts]
    xk = [x * (p.concurrent - 1) for x, p in zip(x1, pts)]
    xl = [float(p.ring_size - 1) for p in pts]
    has_k = any(v != 0 for v in xk)
    # Try the full model, then drop terms the data cannot support (singular) or that come out negative.
    for use_k, use_l in ((has_k, True), (has_k, False), (False, True), (False, False)):
        cols = [x1] + ([xk] if use_k else []) + ([xl] if use_l else [])
        sol = _least_squares([list(r) for r in zip(*cols)], y, w)
        if sol is None or sol[0] <= 0 or any(v < 0 for v in sol[1:]):
            continue
        inv_bw = sol[0]
        c = sol[1] / inv_bw if use_k else 1.0
        lat = sol[-1] if use_l else 0.0
        model = AllReduceModel(bandwidth_bytes_per_s=1.0 / inv_bw, latency_s=lat, contention=c, points=pts)
        errs = [
            abs(model.time_s(p.bytes, p.ring_size, p.concurrent) - p.time_s) / max(p.time_s, 1e-12)
            for p in pts
        ]
        model.fit_rms_rel_error = math.sqrt(sum(e * e for e in errs) / len(errs))
        model.fit_max_rel_error = max(errs)
        return model
    raise ValueError("all-reduce measurements do not grow with message size; cannot fit a bandwidth")
