"""The throughput matrix: examples/s of each job on c VMs of each type, for every count c.

Gavel's policies need each job's throughput on each accelerator type. Here a job runs on c VMs of
one type, and pipelines do not scale linearly with c (bubbles, all-reduce, memory forcing deeper
pipelines), so the matrix has one entry per (job, type, count). The entries come from the
simulator's auto-config (``simulator.autoconfig.autoconfigure``) run on the job's calibration for
that VM type with c × slots accelerators: the best P×D's examples/s, 0 where nothing fits.

Predictions are corrected by what the job measures as it runs: one factor per (job, type), an
exponentially weighted mean of measured / predicted (Note [Measured correction]).

    >>> m = ThroughputMatrix.from_table({"a": {"k80": [1.0, 1.8], "v100": [4.0, 7.0]}})
    >>> m.rate("a", "v100", 2), m.rate("a", "v100", 3), m.configs("a")
    (7.0, 0.0, [('k80', 1), ('k80', 2), ('v100', 1), ('v100', 2)])
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from manager.allocation.pool import VMType, check_types
from varuna.core.calibration import Calibration
from varuna.core.schedule import DEFAULT_SCHEDULE

__all__ = [
    "Config",
    "JobProfile",
    "ThroughputMatrix",
    "ThroughputModel",
    "predict_rates",
]

Config = tuple[str, int]
"""(VM type, VM count): where a job runs during a round."""


@dataclass(frozen=True)
class ThroughputMatrix:
    """``rates[job][(type, count)]`` in examples/s; a missing entry is 0 (the job cannot run
    there: it does not fit, or the count exceeds what it may use)."""

    rates: Mapping[str, Mapping[Config, float]]

    def __post_init__(self) -> None:
        for job, row in self.rates.items():
            for (t, c), r in row.items():
                if c < 1 or not math.isfinite(r) or r < 0:
                    raise ValueError(
                        f"throughput of job {job!r} on {c} × {t} is {r}: rates must be finite and >= 0 "
                        "and counts >= 1; fix the matrix"
                    )

    @classmethod
    def from_table(cls, table: Mapping[str, Mapping[str, Sequence[float]]]) -> ThroughputMatrix:
        """From ``{job: {type: [rate at 1 VM, at 2 VMs, ...]}}`` (tests, hand-made matrices)."""
        return cls({j: {(t, i + 1): float(r) for t, rs in row.items() for i, r in enumerate(rs)}
                    for j, row in table.items()})

    @property
    def jobs(self) -> list[str]:
        return list(self.rates)

    def rate(self, job: str, vm_type: str, count: int) -> float:
        return float(self.rates.get(job, {}).get((vm_type, count), 0.0))

    def configs(self, job: str) -> list[Config]:
        """The (type, count) pairs where ``job`` makes progress, sorted."""
        return sorted(cfg for cfg, r in self.rates.get(job, {}).items() if r > 0)

    def best_rate(self, job: str) -> float:
        return max((r for r in self.rates.get(job, {}).values()), default=0.0)

    def restricted(self, jobs: Sequence[str]) -> ThroughputMatrix:
        return ThroughputMatrix({j: dict(self.rates.get(j, {})) for j in jobs})

    def agnostic(self) -> ThroughputMatrix:
        """The heterogeneity-agnostic view (Gavel's baseline): every type has the job's mean rate
        over the types at that count (a type the job cannot use counts as 0), so a policy cannot
        tell the types apart.

        >>> ThroughputMatrix.from_table({"a": {"x": [1.0], "y": [3.0]}}).agnostic().rate("a", "x", 1)
        2.0
        """
        types = sorted({t for row in self.rates.values() for t, _ in row})
        out: dict[str, dict[Config, float]] = {}
        for job, row in self.rates.items():
            counts = sorted({c for _, c in row})
            mean = {c: sum(row.get((t, c), 0.0) for t in types) / len(types) for c in counts}
            out[job] = {(t, c): mean[c] for t in types for c in counts}
        return ThroughputMatrix(out)


@dataclass(frozen=True)
class JobProfile:
    """What the matrix needs to know about a job."""

    job_id: str
    global_batch_size: int
    calibrations: Mapping[str, Calibration]
    """Per VM type name; a type without one is a type the job does not run on."""
    max_vms: int
    """Most VMs the job may use (its spec's ``max_vms``)."""
    schedule: str = DEFAULT_SCHEDULE
    cache_key: str = ""
    """Identifies the calibrations for the prediction cache (default: a hash of their content
    without the creation time), so jobs of the same model share predictions."""


def predict_rates(
    cal: Calibration,
    vm_type: VMType,
    counts: Sequence[int],
    *,
    global_batch_size: int,
    schedule: str = DEFAULT_SCHEDULE,
) -> dict[int, float]:
    """Examples/s of the best P×D auto-config finds on c VMs of ``vm_type``, for each c.

    A job given c VMs may leave some idle, so the rate never falls as c grows (a running maximum
    over the counts); a count where nothing fits gets 0 (the model needs more memory than c VMs
    have: the policy then never picks it).

    >>> cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
    >>> r = predict_rates(cal, VMType("x", 1.0), [1, 2], global_batch_size=16)
    >>> r[2] > r[1] > 0
    True
    """
    # Imported here, as manager.domain.policy does: the simulator is optional on a manager host, and a
    # matrix given by hand (ThroughputModel.set_predicted) needs none.
    from simulator.autoconfig import autoconfigure

    out: dict[int, float] = {}
    best = 0.0
    for c in sorted(counts):
        try:
            res = autoconfigure(
                cal,
                gpus=c * vm_type.slots,
                global_batch_size=global_batch_size,
                gpu_memory_bytes=vm_type.gpu_memory_bytes or None,
                host_slots=vm_type.slots,
                schedule=schedule,
            )
            rate = float(res.best.examples_per_s or 0.0)
        except ValueError:  # does not fit at this count: 0, a larger count may fit
            rate = 0.0
        best = max(best, rate)
        out[c] = best
    return out


# Note [Measured correction]: the simulator's prediction for a type is off by a factor that
# mostly does not depend on the count (a calibration measured on a quieter VM, a driver
# difference), so one factor per (job, type), f ← (1 − α)·f + α·measured/predicted, corrects every
# count of that type from a run at any count. α = 0.3 follows a changed VM within a few reports
# while one noisy report moves the factor by at most 30 % of its error. Reports ≤ 0 or non-finite
# (a stalled or restarting job) are ignored: stalls are the fail-stutter rule's business.
#
# A type the job has not run on yet starts from the geometric mean of the job's factors on the
# types it has run on (1.0 when none). Every type's prediction comes from one calibration scaled
# by the type's speed, so most of a calibration's error is the job's, not the type's: a job whose
# calibration is 5× pessimistic measures 5× on the slow type it was placed on first, and leaving
# the fast type it never saw at 1.0 would make slow look better than fast, so a round that frees
# fast VMs would keep the job on slow (the pool e2e test caught exactly that on a slow CI machine).


@dataclass
class ThroughputModel:
    """Predicted rates per job × type × count, cached, with measured corrections.

    Example::

        model = ThroughputModel([VMType("k80", 0.3), VMType("v100", 0.9)])
        model.add_job(JobProfile(job_id="a", global_batch_size=64, calibrations={...}, max_vms=4))
        model.observe("a", "v100", 2, measured=5.1)   # examples/s the job reported
        matrix = model.matrix()                        # corrected rates for the policies
    """

    types: Sequence[VMType]
    alpha: float = 0.3
    _types: dict[str, VMType] = field(init=False)
    _predicted: dict[str, dict[Config, float]] = field(default_factory=dict, init=False)
    _factor: dict[tuple[str, str], float] = field(default_factory=dict, init=False)
    _cache: dict[tuple, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._types = check_types(self.types)
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def add_job(self, profile: JobProfile) -> None:
        """Predict ``profile``'s rates on every type it has a calibration for, counts 1..max_vms."""
        if profile.max_vms < 1:
            raise ValueError(f"job {profile.job_id!r}: max_vms must be >= 1, got {profile.max_vms}")
        unknown = sorted(set(profile.calibrations) - set(self._types))
        if unknown:
            raise ValueError(
                f"job {profile.job_id!r} has calibrations for {', '.join(unknown)}, which the pool does not "
                "list; add the type to the pool or drop the calibration"
            )
        key = profile.cache_key or _content_key(profile.calibrations)
        row: dict[Config, float] = {}
        for name, cal in sorted(profile.calibrations.items()):
            counts = range(1, profile.max_vms + 1)
            # The rate at c does not depend on max_vms (a running maximum from c = 1), so jobs of
            # one model with different max_vms share the cache.
            ck = (key, name, profile.global_batch_size, profile.schedule)
            if any(ck + (c,) not in self._cache for c in counts):
                rates = predict_rates(cal, self._types[name], counts,
                                      global_batch_size=profile.global_batch_size, schedule=profile.schedule)
                self._cache.update({ck + (c,): r for c, r in rates.items()})
            row.update({(name, c): self._cache[ck + (c,)] for c in counts})
        self._predicted[profile.job_id] = row

    def set_predicted(self, job_id: str, rates: Mapping[Config, float]) -> None:
        """Use given predictions for a job (a matrix made elsewhere, tests)."""
        self._predicted[job_id] = dict(rates)

    def remove_job(self, job_id: str) -> None:
        self._predicted.pop(job_id, None)
        for k in [k for k in self._factor if k[0] == job_id]:
            del self._factor[k]

    def has_job(self, job_id: str) -> bool:
        return job_id in self._predicted

    def factors(self, job_id: str) -> dict[str, float]:
        """The job's measured corrections per type (only the types measured so far)."""
        return {t: f for (j, t), f in self._factor.items() if j == job_id}

    def set_factor(self, job_id: str, vm_type: str, factor: float) -> None:
        """Restore a stored correction (a restarted manager)."""
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"correction of job {job_id!r} on {vm_type} must be > 0, got {factor}")
        self._factor[(job_id, vm_type)] = float(factor)

    def predicted(self, job_id: str, vm_type: str, count: int) -> float:
        return self._predicted.get(job_id, {}).get((vm_type, count), 0.0)

    def factor(self, job_id: str, vm_type: str) -> float:
        """The measured/predicted correction for (job, type); for a type not measured yet, the
        geometric mean of the job's factors on the types measured (1.0 when none; Note [Measured
        correction]).

        >>> m = ThroughputModel([VMType("x", 1.0), VMType("y", 2.0)])
        >>> m.set_factor("a", "x", 4.0)
        >>> m.factor("a", "y"), m.factor("b", "y")
        (4.0, 1.0)
        """
        own = self._factor.get((job_id, vm_type))
        if own is not None:
            return own
        seen = [f for (j, _), f in self._factor.items() if j == job_id]
        return math.exp(sum(math.log(f) for f in seen) / len(seen)) if seen else 1.0

    def observe(self, job_id: str, vm_type: str, count: int, measured: float) -> float:
        """Fold a measured rate (examples/s on ``count`` VMs of ``vm_type``) into the job's
        correction for that type (Note [Measured correction]); returns the new factor.

        >>> m = ThroughputModel([VMType("x", 1.0)])
        >>> m.set_predicted("a", {("x", 1): 10.0})
        >>> m.observe("a", "x", 1, 5.0), m.matrix().rate("a", "x", 1)
        (0.85, 8.5)
        """
        pred = self.predicted(job_id, vm_type, count)
        old = self.factor(job_id, vm_type)
        if pred <= 0 or not math.isfinite(measured) or measured <= 0:
            return old
        new = (1.0 - self.alpha) * old + self.alpha * (measured / pred)
        self._factor[(job_id, vm_type)] = new
        return new

    def matrix(self, jobs: Sequence[str] | None = None) -> ThroughputMatrix:
        """Corrected rates for ``jobs`` (default: every job added)."""
        names = list(self._predicted) if jobs is None else list(jobs)
        return ThroughputMatrix({
            j: {cfg: r * self.factor(j, cfg[0]) for cfg, r in self._predicted.get(j, {}).items()}
            for j in names
        })


def _content_key(calibrations: Mapping[str, Calibration]) -> str:
    """A hash of the calibrations' content, without their creation time (two profiles of the same
    model and type share predictions)."""
    h = hashlib.sha256()
    for name in sorted(calibrations):
        d = calibrations[name].to_dict()
        d.pop("created", None)
        h.update(name.encode() + json.dumps(d, sort_keys=True).encode())
    return h.hexdigest()[:16]
