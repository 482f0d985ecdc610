"""The worker's one parser of its environment (Note [One parser] in varuna/core/env.py):
ProcessEnv (identity as far as the launcher gave it, the run plan, the pass-through settings),
WorkerSettings, RunPlan; unset values are defaults, malformed ones one line naming the variable;
and the runtime reads the environment through it only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from varuna.core.env import PLAN_VARS, SETTING_VARS, ProcessEnv, RunPlan, WorkerEnv, WorkerSettings

ROOT = Path(__file__).resolve().parent.parent


def test_nothing_set_is_one_process_with_nothing_planned():
    env = ProcessEnv.from_env({})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert (env.pipeline_depth, env.data_parallel, env.torchrun) == (None, None, False)
    assert env.plan == RunPlan() and env.settings == WorkerSettings()


def test_a_launched_worker_reads_what_the_launcher_wrote():
    plan = RunPlan(global_batch_size=32, schedule="1f1b", micro_batch_size=4, stage_ranges=((0, 1), (2, 3)))
    settings = {"VARUNA_CHECKPOINT_DIR": "/ckpt", "VARUNA_RESUME": "auto", "VARUNA_CUT_AFTER": "a.*, b",
                "VARUNA_AUTO_CUTPOINTS": "", "VARUNA_PLAN_COST": "time", "VARUNA_TENSORBOARD_DIR": "/tb",
                "VARUNA_NETEM": "latency=5ms", "VARUNA_ENGINE_PLUGINS": "m:f", "VARUNA_LIVE_STORE": "h:1",
                "VARUNA_LIVE_JOIN": "1", "VARUNA_COMM_BACKEND": "gloo", "VARUNA_PEAK_TFLOPS": "989.4",
                "VARUNA_FENCE_EPOCH": "17", "VARUNA_GENERATION": "3", "VARUNA_RESTARTS": "1",
                "VARUNA_LIVE_STORE_KEY": "k" * 64, "VARUNA_LIFECYCLE": "1"}
    worker = WorkerEnv(master_addr="h0", master_port=29500, rank=3, world_size=4, local_rank=1,
                       local_world_size=2, pipeline_depth=2, data_parallel=2,
                       extra={**plan.to_env(), **settings})
    env = ProcessEnv.from_env(worker.to_env())
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.pipeline_depth, env.data_parallel) == (2, 2)
    assert env.plan == plan == worker.plan
    assert env.settings == worker.settings == WorkerSettings(
        checkpoint_dir="/ckpt", resume="auto", cut_after=("a.*", "b"), auto_cutpoints=None, plan_cost="time",
        tensorboard_dir="/tb", netem="latency=5ms", engine_plugins="m:f", live_store="h:1", live_join=True,
        comm_backend="gloo", peak_tflops=989.4, fence_epoch=17, generation=3, live_store_key="k" * 64,
        lifecycle=True)
    assert set(settings) == set(SETTING_VARS)
    assert "k" * 64 not in repr(env), "the store's secret is never printed"


@pytest.mark.parametrize(
    "var,value,words",
    [
        ("RANK", "one", "RANK='one' is not an integer"),
        ("WORLD_SIZE", "0", "WORLD_SIZE=0 must be >= 1"),
        ("LOCAL_WORLD_SIZE", "x", "LOCAL_WORLD_SIZE='x' is not an integer"),
        ("VARUNA_PIPELINE_DEPTH", "0", "VARUNA_PIPELINE_DEPTH=0 must be >= 1"),
        ("VARUNA_PIPELINE_DEPTH", "two", "VARUNA_PIPELINE_DEPTH='two' is not an integer"),
        ("VARUNA_DATA_PARALLEL", "-2", "VARUNA_DATA_PARALLEL=-2 must be >= 1"),
        ("VARUNA_GLOBAL_BATCH_SIZE", "3.5", "VARUNA_GLOBAL_BATCH_SIZE='3.5' is not an integer"),
        ("VARUNA_MICRO_BATCH_SIZE", "0", "micro_batch_size must be >= 1, got 0"),
        ("VARUNA_SCHEDULE", "zigzag", "unknown schedule 'zigzag' (VARUNA_SCHEDULE)"),
        ("VARUNA_CHUNKS", "x", "VARUNA_CHUNKS='x' is not an integer"),
        ("VARUNA_STAGE_RANGES", "0:3", "VARUNA_STAGE_RANGES='0:3' is not like '0-3,4-7'"),
        ("VARUNA_REPLICA_SHARES", "3;1", "VARUNA_REPLICA_SHARES='3;1' is not a comma-separated list"),
        ("VARUNA_STAGE_SPEEDS", "fast", "VARUNA_STAGE_SPEEDS='fast' is not a comma-separated list"),
        ("VARUNA_AUTO_CUTPOINTS", "0", "VARUNA_AUTO_CUTPOINTS=0 must be >= 1"),
        ("VARUNA_FENCE_EPOCH", "soon", "VARUNA_FENCE_EPOCH='soon' is not an integer"),
        ("VARUNA_RESTARTS", "-1", "VARUNA_GENERATION/VARUNA_RESTARTS=-1 must be >= 0"),
        ("VARUNA_PLAN_COST", "fast", "VARUNA_PLAN_COST='fast' is not flop or time"),
        ("VARUNA_RECOMPUTE", "yes", "VARUNA_RECOMPUTE='yes' is not 1 or 0"),
        ("VARUNA_SHARD_OPTIMIZER", "2", "VARUNA_SHARD_OPTIMIZER='2' is not 1 or 0"),
        ("VARUNA_LIFECYCLE", "yes", "WorkerSettings: VARUNA_LIFECYCLE='yes' is not 1 or 0"),
        ("VARUNA_COMM_BACKEND", "mpi", "VARUNA_COMM_BACKEND='mpi' is not nccl or gloo"),
        ("VARUNA_PEAK_TFLOPS", "fast", "VARUNA_PEAK_TFLOPS='fast' is not a peak TFLOP/s"),
        ("VARUNA_PEAK_TFLOPS", "-1", "VARUNA_PEAK_TFLOPS='-1' is not a peak TFLOP/s"),
    ],
)
def test_a_malformed_value_is_one_line_naming_the_variable(var, value, words):
    with pytest.raises(ValueError) as err:
        ProcessEnv.from_env({var: value})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_every_plan_variable_round_trips():
    plan = RunPlan(global_batch_size=8, micro_batch_size=2, schedule="interleaved", chunks=2,
                   stage_ranges=((0, 1), (2, 3), (4, 5), (6, 7)), replica_shares=(3, 1),
                   stage_speeds=(1.0, 1.5), recompute=False, recompute_segments=(1, 3), shard_optimizer=True)
    assert set(plan.to_env()) == set(PLAN_VARS)
    assert ProcessEnv.from_env(plan.to_env()).plan == plan
    empty = RunPlan(recompute_segments=())  # the empty set (recompute nothing) is not "unset"
    assert ProcessEnv.from_env(empty.to_env()).plan == empty


# The runtime's reads of the environment go through varuna/core/env.py (Note [One parser]). Writes
# stay where they are: the live trainer drops plan variables sized for an old layout, the local-world
# spawner builds its children's environment, gloo's interface and deterministic mode's cuBLAS
# workspace setting go where gloo and cuBLAS read them.
_WRITERS = {"varuna/runtime/live_trainer.py": {"pop"}, "varuna/testing/emulated.py": {"get"},
            "varuna/runtime/layout.py": {"update"}, "varuna/runtime/determinism.py": {"update"},
            "varuna/testing/netns.py": {"get"}}  # the namespaces' children inherit this environment


def test_the_runtime_reads_its_environment_only_through_the_one_parser():
    found = []
    for package in ("varuna/runtime", "varuna/testing", "varuna/cutting"):
        for path in sorted((ROOT / package).glob("*.py")):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                reads = (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                         and isinstance(node.value, ast.Name) and node.value.id == "os")
                if reads:
                    found.append((rel, node.lineno))
    allowed = []
    for rel, line in found:
        text = (ROOT / rel).read_text().splitlines()[line - 1]
        if any(f"os.environ.{op}" in text or "**os.environ" in text for op in _WRITERS.get(rel, ())):
            allowed.append((rel, line))
    assert sorted(set(found) - set(allowed)) == [], "read VARUNA_*/torchrun variables through varuna.core.env"
    assert allowed, "negative control: the scan sees os.environ"
