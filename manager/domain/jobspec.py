"""The job specification: what ``varuna-manager submit JOBSPEC`` reads (JSON or TOML).

A job spec names the training script and its arguments, the global batch size (kept across
every morph, so the training semantics never change), where checkpoints go, which provider
supplies VMs and how many, and when the job is done. Paths are resolved against the spec file's
directory at submit time, so the manager (possibly on another machine or in another working
directory) receives absolute paths. Example (TOML)::

    name = "gpt-tiny"
    script = "examples/gpt2/train.py"
    args = ["--steps", "40", "--n-layer", "4", "--n-embd", "32"]
    global_batch_size = 24
    micro_batch_size = 2
    checkpoint_dir = "runs/gpt-tiny/ckpt"
    checkpoint_every = 2
    provider = "local"
    min_vms = 2
    max_vms = 6
    procs_per_vm = 1
    target_steps = 40
    schedule = "varuna"                  # optional (default varuna): the plan the workers get
    chunks = 1                           # optional: model chunks per process (interleaved kinds: >= 2)
    calibration = "calibration.json"     # optional: the simulator picks P×D from it

    # ... or, instead of a calibration file: calibrate once on the job's first VM
    # [profile]
    # model = "examples/gpt2/profile_target.py:build"
    # model_args = { n_layer = 4, n_embd = 32, n_head = 2, block_size = 32 }
    # micro_batch_sizes = [2]
    # args = ["--reps", "3"]
    # timeout_s = 600

Every problem is a ``ValueError`` with one line naming the field and the fix.

    >>> spec = JobSpec.from_dict({"script": "/t.py", "global_batch_size": 8, "checkpoint_dir": "/c",
    ...                           "max_vms": 2, "target_steps": 5})
    >>> spec.min_vms, spec.procs_per_vm, spec.provider
    (1, 1, 'local')
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from manager.domain.vm_types import VMTypeSpec, parse_vm_types
from manager.providers.registry import JobShape, provider_entry
from varuna.core.schedule import DEFAULT_SCHEDULE, SCHEDULE_KINDS, chunks_problem, schedule_kind

__all__ = ["MAX_CHUNKS", "MAX_COUNT", "MAX_PROCS_PER_VM", "MAX_VMS", "JobSpec", "ProfileSpec", "load_jobspec"]

#: Most VMs one job may ask for: the manager is sized and load-tested for 1,000 VMs (docs/manager.md);
#: a larger number is a typo that would have the provider create VMs without end.
MAX_VMS = 1024
#: Most workers per VM (accelerators of one machine; the largest VM sizes hold 8-16).
MAX_PROCS_PER_VM = 64
#: Largest step count, batch size or segment count a spec may name: far beyond any run (10^12
#: steps at 1,000 a second take 31 years), yet it keeps every such number well inside the wire's
#: and the state file's 64-bit integers (a target of 10^19 once made every status call fail).
MAX_COUNT = 10**12
_COUNTS = ("global_batch_size", "target_steps", "micro_batch_size", "checkpoint_every", "num_segments")
#: Most model chunks per process (interleaved kinds; each is a copy of the stage's modules).
MAX_CHUNKS = 64
#: Largest accelerator memory (GiB) and priority weight a spec may name.
MAX_MEMORY_GIB = 1 << 20
MAX_WEIGHT = 1e6

# Environment variables the manager sets per worker itself: a spec may not override them.
_RESERVED_ENV_PREFIXES = ("VARUNA_MANAGER", "VARUNA_JOB_ID", "VARUNA_VM_ID", "VARUNA_GENERATION",
                           "VARUNA_FENCE_EPOCH")

# varuna-profile flags that [profile] sets through its own keys (or the agent, for --out).
_PROFILE_FLAGS_OF_KEYS = {
    "--model": "set it with profile.model",
    "--model-arg": "set them with profile.model_args",
    "--micro-batch-sizes": "set them with profile.micro_batch_sizes",
    "--out": "the agent chooses the output file",
    "--update": "a job is calibrated from scratch",
}

#: Micro-batch sizes profiled when neither [profile] nor the job names any.
DEFAULT_PROFILE_MICRO_BATCH_SIZES = (1, 2, 4)


@dataclass(frozen=True, kw_only=True)
class ProfileSpec:
    """The job spec's ``[profile]`` table: how the manager calibrates the job on its first VM
    (``varuna-profile``) when the spec carries no calibration file (docs/manager.md).

        >>> p = ProfileSpec.from_dict({"model": "m.py:build", "model_args": {"n_layer": 2},
        ...                            "args": ["--reps", "1"]})
        >>> p.profiler_args(job_micro_batch_size=2)
        ['--model', 'm.py:build', '--model-arg', 'n_layer=2', '--micro-batch-sizes', '2', '--reps', '1']
    """

    model: str
    """``varuna-profile --model``: ``path/to/file.py:factory`` (resolved against the spec file's
    directory) or ``package.module:factory``."""
    model_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the factory (``--model-arg KEY=VALUE``, VALUE as JSON)."""
    micro_batch_sizes: list[int] = field(default_factory=list)
    """m values to measure; default: the job's ``micro_batch_size``, else 1, 2, 4."""
    args: list[str] = field(default_factory=list)
    """Further ``varuna-profile`` flags, e.g. ``["--reps", "3", "--host-emulation", "loopback"]``."""
    timeout_s: float = 600.0
    """The run is killed (and counts as failed) after this long."""
    required: bool = False
    """A failed or timed-out calibration fails the job (default: plan with the fallback rule)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProfileSpec:
        """Validate a parsed ``[profile]`` table; ``ValueError`` (one line, with the fix)."""
        if not isinstance(data, Mapping):
            raise ValueError("jobspec: 'profile' must be a table/object with at least 'model'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"jobspec: unknown profile field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        model = data.get("model")
        where, sep, factory = str(model or "").rpartition(":")
        if not isinstance(model, str) or not sep or not where or not factory:
            raise ValueError(
                "jobspec: profile.model must name the varuna-profile target as module_or_file:factory, "
                "e.g. examples/gpt2/profile_target.py:build"
            )
        spec = cls(**dict(data))
        if not isinstance(spec.model_args, dict) or not all(
            isinstance(k, str) and k.isidentifier() for k in spec.model_args
        ):
            raise ValueError("jobspec: profile.model_args must map Python identifiers to values")
        try:
            for value in spec.model_args.values():
                json.dumps(value)
        except (TypeError, ValueError):
            raise ValueError("jobspec: profile.model_args values must be JSON values") from None
        ms = spec.micro_batch_sizes
        if not isinstance(ms, list) or len(ms) > 64 or not all(
            isinstance(m, int) and not isinstance(m, bool) and 1 <= m <= MAX_COUNT for m in ms
        ):
            raise ValueError(
                f"jobspec: profile.micro_batch_sizes must be a list of integers >= 1 (at most 64 of"
                f" them, each <= 10^12), got {str(ms)[:200]}"
            )
        if not isinstance(spec.args, list) or not all(isinstance(a, str) for a in spec.args):
            raise ValueError("jobspec: profile.args must be a list of strings (varuna-profile flags)")
        for arg in spec.args:
            flag = arg.split("=", 1)[0]
            if flag in _PROFILE_FLAGS_OF_KEYS:
                why = _PROFILE_FLAGS_OF_KEYS[flag]
                raise ValueError(f"jobspec: profile.args may not contain {flag}: {why}")
        timeout = spec.timeout_s
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 1e7:
            raise ValueError(f"jobspec: profile.timeout_s must be a number of seconds > 0, got {timeout!r}")
        if not isinstance(spec.required, bool):
            raise ValueError(f"jobspec: profile.required must be true or false, got {spec.required!r}")
        return spec

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (the ``[profile]`` table)."""
        return asdict(self)

    def resolved(self, base: Path) -> ProfileSpec:
        """A copy whose model file (``file.py:factory``) is absolute against ``base``."""
        where, _, factory = self.model.rpartition(":")
        if where.endswith(".py") or "/" in where or os.sep in where:
            where = str((base / os.path.expanduser(where)).resolve())
        return ProfileSpec(**{**self.to_dict(), "model": f"{where}:{factory}"})

    def profiler_args(self, *, job_micro_batch_size: int = 0) -> list[str]:
        """``varuna-profile`` arguments of this profile, without ``--out``."""
        ms = self.micro_batch_sizes or (
            [job_micro_batch_size] if job_micro_batch_size else list(DEFAULT_PROFILE_MICRO_BATCH_SIZES)
        )
        argv = ["--model", self.model]
        for key, value in self.model_args.items():
            argv += ["--model-arg", f"{key}={json.dumps(value)}"]
        argv += ["--micro-batch-sizes", ",".join(str(m) for m in ms)]
        return argv + list(self.args)


@dataclass(kw_only=True)
class JobSpec:
    """A training job as submitted (after validation and path resolution)."""

    name: str = ""
    """Free-form label shown by ``status``; defaults to the script's file name."""
    script: str
    """Training script (absolute after :meth:`resolved`), or a module name when ``module``."""
    args: list[str] = field(default_factory=list)
    """Arguments for the script, unchanged (they should make it stop at ``target_steps``)."""
    module: bool = False
    """Run ``python -m script`` instead of a file."""
    workdir: str = ""
    """Working directory of the workers; default: the spec file's directory."""
    global_batch_size: int
    """M_total: examples per optimizer step at every P×D."""
    micro_batch_size: int = 0
    """m used by the script; 0 lets auto-config choose (it is then exported as
    ``VARUNA_MICRO_BATCH_SIZE``)."""
    checkpoint_dir: str
    """Global checkpoint store (``VARUNA_CHECKPOINT_DIR``); every relaunch resumes from it."""
    checkpoint_every: int = 0
    """Periodic checkpoint interval in steps (``VARUNA_CHECKPOINT_EVERY``, applied by the worker
    shim); bounds the steps redone after an unannounced VM loss. 0: the script decides."""
    provider: str = "local"
    """Where VMs come from: a provider of the registry (``manager.providers.registry``):
    ``local`` (pretend VMs on this machine), ``azure``, or one a module registers."""
    provider_options: dict[str, Any] = field(default_factory=dict)
    """Provider settings (docs/manager.md): e.g. ``metadata_url`` (local), ``resource_group``,
    ``vm_size`` (azure)."""
    min_vms: int = 1
    """Fewest usable VMs the job runs on; below that it waits for VMs."""
    max_vms: int
    """Most VMs the manager asks the provider for."""
    procs_per_vm: int = 1
    """Workers (accelerators) per VM."""
    target_steps: int
    """The job is done when its workers exit 0 having reached this step."""
    calibration: str = ""
    """Calibration file (optional): auto-config and the fail-stutter predictions use it."""
    profile: dict[str, Any] = field(default_factory=dict)
    """``[profile]`` (:class:`ProfileSpec`), instead of ``calibration``: the manager calibrates the
    job with ``varuna-profile`` on its first VM. Empty (and no ``calibration``): fallback rule."""
    pipeline_depth: int = 0
    """Force P (0: choose)."""
    num_segments: int = 0
    """The model's segments (cut-points + 1) for the fallback P choice when there is no
    calibration; P then divides it."""
    gpu_memory_gib: float = 0.0
    """Accelerator memory for auto-config (0: unknown, no memory limit)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every worker (e.g. ``OMP_NUM_THREADS``)."""
    schedule: str = DEFAULT_SCHEDULE
    """Pipeline schedule of the job (``varuna.core.schedule.SCHEDULE_KINDS``; default
    ``varuna``): auto-config plans P×D for it and the workers get it in their run plan
    (``VARUNA_SCHEDULE``). The manager never reads the script's arguments: a script that leaves
    its schedule unset runs the plan's, one that sets another is refused by its engine with one
    line naming both (``varuna.runtime.config.adopt_plan``). Empty: the default."""
    chunks: int = 0
    """Model chunks per process for the interleaved kinds (>= 2 there, docs/interleaved.md):
    auto-config plans for it and the workers' engines run with it (``VARUNA_CHUNKS``, as
    ``varuna-launch --chunks``). 0: not set (one chunk; the workers get nothing)."""
    pool: bool = False
    """Run on the manager's shared pool (``serve --pool``, docs/pool.md): the pool's rounds decide
    the VM type and count (at most ``max_vms``), not the job itself."""
    weight: float = 1.0
    """Priority in the pool: a job of weight 2 gets twice the normalised throughput (``las``)."""
    vm_types: list[dict[str, Any]] = field(default_factory=list)
    """``[[vm_types]]``: a pool of several VM types for this job (:mod:`manager.domain.vm_types`); empty:
    one type. ``max_vms`` is then the sum of the types' ``max_vms``."""
    live_morph: bool = False
    """Morph without a restart (docs/manager.md, Live morph): when a VM is lost and every stage
    keeps a replica, the survivors regroup in their processes (the script uses
    ``varuna.runtime.live_trainer.LiveTrainer`` when ``$VARUNA_LIVE_STORE`` is set); otherwise
    the usual relaunch from the newest checkpoint."""

    def __post_init__(self) -> None:
        if isinstance(self.schedule, str) and not self.schedule:
            self.schedule = DEFAULT_SCHEDULE
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` (one line, with the fix) if the spec cannot run."""
        if not isinstance(self.script, str) or not self.script:
            raise ValueError("jobspec: 'script' is required: the training script (or module) to run")
        if not isinstance(self.args, list) or not all(isinstance(a, str) for a in self.args):
            raise ValueError("jobspec: 'args' must be a list of strings")
        self._check_counts()
        self._check_provider()
        if not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir:
            raise ValueError("jobspec: 'checkpoint_dir' is required: morphs resume from its checkpoints")
        self._check_env()
        memory = self.gpu_memory_gib
        is_number = isinstance(memory, (int, float)) and not isinstance(memory, bool)
        if not is_number or not 0 <= memory <= MAX_MEMORY_GIB:
            raise ValueError(
                f"jobspec: 'gpu_memory_gib' must be a number in 0..{MAX_MEMORY_GIB}, got {memory!r}"
            )
        self._check_calibration()
        if self.pipeline_depth and self.pipeline_depth > self.max_vms * self.procs_per_vm:
            raise ValueError(
                f"jobspec: pipeline_depth {self.pipeline_depth} exceeds the "
                f"{self.max_vms * self.procs_per_vm}"
                " slots of max_vms × procs_per_vm; raise max_vms or lower pipeline_depth"
            )
        self._check_schedule()
        self._check_chunks()
        if not isinstance(self.pool, bool):
            raise ValueError(f"jobspec: 'pool' must be true or false, got {self.pool!r}")
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_WEIGHT:
            raise ValueError(f"jobspec: 'weight' must be a number in (0, {MAX_WEIGHT:g}], got {weight!r}")
        self._check_vm_types()
        self._check_live_morph()

    def _check_live_morph(self) -> None:
        if not isinstance(self.live_morph, bool):
            raise ValueError(f"jobspec: 'live_morph' must be true or false, got {self.live_morph!r}")
        if not self.live_morph:
            return
        if self.pool:
            raise ValueError("jobspec: live_morph is not supported for pool jobs (pool = true) yet; "
                             "drop one of them")
        if self.vm_types:
            raise ValueError("jobspec: live_morph is not supported with several VM types ([[vm_types]]) "
                             "yet; drop one of them")
        if schedule_kind(self.schedule).weight_versions > 1:
            raise ValueError(f"jobspec: live_morph does not carry the {self.schedule} schedule's second "
                             "weight version; use a synchronous schedule or drop live_morph")
        if self.chunks > 1:
            raise ValueError(f"jobspec: live_morph does not carry interleaved stages (chunks = "
                             f"{self.chunks}) yet; drop live_morph or use a one-chunk schedule")

    def _check_vm_types(self) -> None:
        if not self.vm_types and isinstance(self.vm_types, list):
            return
        types = parse_vm_types(self.vm_types)
        if self.pool:
            raise ValueError(
                "jobspec: a pool job (pool = true) gets its VM types from the pool; drop vm_types"
            )
        entry = provider_entry(self.provider)
        for t in types:
            entry.check_type_options(t.name, t.provider_options, self.provider_options)
        total = sum(t.max_vms for t in types)
        if self.max_vms != total:
            raise ValueError(
                f"jobspec: max_vms {self.max_vms} differs from the sum of the vm_types' max_vms ({total});"
                f" set max_vms = {total}"
            )

    def _check_counts(self) -> None:
        for name in ("global_batch_size", "max_vms", "target_steps"):
            if _int(self, name) < 1:
                raise ValueError(f"jobspec: '{name}' must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("micro_batch_size", "checkpoint_every", "pipeline_depth", "num_segments", "chunks"):
            if _int(self, name) < 0:
                raise ValueError(f"jobspec: '{name}' must be an integer >= 0, got {getattr(self, name)!r}")
        for name in ("min_vms", "procs_per_vm"):
            if _int(self, name) < 1:
                raise ValueError(f"jobspec: '{name}' must be an integer >= 1, got {getattr(self, name)!r}")
        if self.min_vms > self.max_vms:
            raise ValueError(
                f"jobspec: min_vms {self.min_vms} exceeds max_vms {self.max_vms}; "
                "raise max_vms or lower min_vms"
            )
        if self.max_vms > MAX_VMS:
            raise ValueError(f"jobspec: max_vms {self.max_vms} is above the limit of {MAX_VMS}; lower it")
        for name in _COUNTS:
            if (value := getattr(self, name)) > MAX_COUNT:
                raise ValueError(f"jobspec: {name} {value} is above the limit of 10^12; lower it")
        if self.chunks > MAX_CHUNKS:
            raise ValueError(f"jobspec: chunks {self.chunks} is above the limit of {MAX_CHUNKS}; lower it")
        if self.procs_per_vm > MAX_PROCS_PER_VM:
            raise ValueError(
                f"jobspec: procs_per_vm {self.procs_per_vm} is above the limit of {MAX_PROCS_PER_VM};"
                " lower it"
            )

    def _check_provider(self) -> None:
        """A registered provider, options that are a table, and whatever that provider checks of
        a job (its registry entry's ``check_job``; the local one bounds the workers on this
        machine). The options themselves are parsed when the job is submitted."""
        try:
            entry = provider_entry(self.provider)
        except ValueError as exc:
            raise ValueError(f"jobspec: {exc}") from None
        if not isinstance(self.provider_options, dict):
            raise ValueError("jobspec: 'provider_options' must be a table/object")
        if entry.check_job is not None:
            try:
                entry.check_job(JobShape(provider=self.provider, max_vms=self.max_vms,
                                         procs_per_vm=self.procs_per_vm, options=self.provider_options))
            except ValueError as exc:
                raise ValueError(f"jobspec: {str(exc).splitlines()[0]}") from None

    def _check_env(self) -> None:
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise ValueError("jobspec: 'env' must map variable names to strings")
        for key in self.env:
            if key.startswith(_RESERVED_ENV_PREFIXES):
                raise ValueError(f"jobspec: env may not set {key}: the manager sets it per worker")

    def _check_calibration(self) -> None:
        if not isinstance(self.calibration, str):
            raise ValueError("jobspec: 'calibration' must be the path of a calibration file")
        if self.profile:
            if self.calibration:
                raise ValueError(
                    "jobspec: give either 'calibration' (a file) or [profile] (calibrate on the first VM), "
                    "not both"
                )
            ProfileSpec.from_dict(self.profile)
        elif not isinstance(self.profile, dict):
            raise ValueError("jobspec: 'profile' must be a table/object with at least 'model'")

    def _check_schedule(self) -> None:
        """A schedule kind the runtime executes."""
        kinds = ", ".join(SCHEDULE_KINDS)
        if not isinstance(self.schedule, str):
            raise ValueError(f"jobspec: 'schedule' must be one of {kinds}, got {self.schedule!r}")
        if self.schedule not in SCHEDULE_KINDS:
            raise ValueError(f"jobspec: unknown schedule {self.schedule!r}; use one of {kinds}")

    def _check_chunks(self) -> None:
        """``chunks`` against the schedule, a forced pipeline depth and the model's segments
        (:func:`varuna.core.schedule.chunks_problem`); an interleaved job also needs some way to
        get P >= 2 (the fallback rule without segments would run P = 1)."""
        schedule = self.schedule
        chunks = 1 if self.chunks == 0 else self.chunks
        problem = chunks_problem(
            schedule,
            chunks,
            pipeline_depth=self.pipeline_depth or None,
            max_cutpoints=self.num_segments - 1 if self.num_segments else None,
            cut_source=f"num_segments = {self.num_segments}",
            flags={"schedule": "schedule = {}", "chunks": "chunks = {}", "depth": "pipeline_depth = {}"},
        )
        if problem is not None:
            raise ValueError(f"jobspec: {problem}")
        if chunks > 1 and not (self.pipeline_depth or self.num_segments or self.calibration or self.profile):
            raise ValueError(
                f"jobspec: schedule = {schedule} with chunks = {chunks} needs pipeline_depth (>= 2), "
                "num_segments, a calibration or [profile] to choose P; set pipeline_depth"
            )
        if chunks > 1 and (self.pool or self.vm_types):
            raise ValueError("jobspec: pool jobs and several VM types ([[vm_types]]) plan one chunk per "
                             "process for now; drop chunks, or pool / vm_types")

    # -- conversions ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "jobspec") -> JobSpec:
        """Build from a parsed JSON/TOML document; unknown keys are errors (a typo would
        otherwise be silently ignored)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: the top level must be an object/table")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        missing = [
            n
            for n in ("script", "global_batch_size", "checkpoint_dir", "max_vms", "target_steps")
            if n not in data
        ]
        if missing:
            raise ValueError(f"{source}: missing required field(s) {', '.join(missing)}")
        try:
            return cls(**dict(data))
        except TypeError as exc:  # a wrong type that comparisons trip over
            raise ValueError(f"{source}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (what the manager stores)."""
        return asdict(self)

    def resolved(self, base_dir: str | os.PathLike) -> JobSpec:
        """A copy with ``script`` (unless a module), ``workdir``, ``checkpoint_dir`` and
        ``calibration`` made absolute against ``base_dir``."""
        base = Path(base_dir).resolve()

        def absolute(p: str) -> str:
            return str((base / os.path.expanduser(p)).resolve()) if p else p

        data = self.to_dict()
        if not self.module:
            data["script"] = absolute(self.script)
        data["workdir"] = absolute(self.workdir) if self.workdir else str(base)
        data["checkpoint_dir"] = absolute(self.checkpoint_dir)
        data["calibration"] = absolute(self.calibration)
        if self.profile:
            data["profile"] = ProfileSpec.from_dict(self.profile).resolved(base).to_dict()
        return JobSpec(**data)

    @property
    def display_name(self) -> str:
        return self.name or Path(self.script).name

    @property
    def vm_type_specs(self) -> tuple[VMTypeSpec, ...]:
        """The validated ``[[vm_types]]`` (empty: VMs of one type)."""
        return parse_vm_types(self.vm_types) if self.vm_types else ()

    @property
    def profile_spec(self) -> ProfileSpec | None:
        """The validated ``[profile]`` table, or None when the spec has none."""
        return ProfileSpec.from_dict(self.profile) if self.profile else None


def _int(spec: JobSpec, name: str) -> int:
    value = getattr(spec, name)
    # bool is an int subclass: `true` for a count is a typo, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"jobspec: '{name}' must be an integer, got {value!r}")
    return value


def load_jobspec(path: str | os.PathLike) -> JobSpec:
    """Read a JSON (``.json``) or TOML (``.toml``, or anything else that is not JSON) job spec and
    resolve its paths against the file's directory. ``ValueError`` (one line) on any problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read job spec {p}: {exc.strerror or exc}") from None
    if p.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{p}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
    else:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError(f"{p}: TOML job specs need Python >= 3.11; write the spec as JSON") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{p}: not valid TOML: {exc}".splitlines()[0]) from None
    spec = JobSpec.from_dict(data, source=str(p))
    return spec.resolved(p.parent)
