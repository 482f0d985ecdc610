"""A model too big for one process (issue #16): it trains pipelined, checkpoints, and resumes at another P.

The GPT example (``examples/gpt2/model.py``, a CutPoint after every block) is built on the
``meta`` device with a size whose fp32 training state -- weights + gradients + AdamW's two moments,
16 bytes a parameter -- is about three times the memory cap each process gets. Then:

1. **one process** tries to train it under the cap (in a subprocess): it must fail with an
   allocation failure (reported as "fails", with where it failed);
2. **P = 4** (world 4, ``VARUNA_PIPELINE_DEPTH=4``) trains it; every stage materialises only its own
   parameters from the meta model (``param_init``), stays under the cap, checkpoints after step
   ``--save-at`` and goes on training (the *continued* run);
3. **8×1 and 4×2** (``--resume-layouts``, any layouts whose stages fit the cap) resume from that
   checkpoint; their losses of the following steps are compared with the continued run's.

The cap is enforced with ``RLIMIT_AS`` in every worker: the process's address space at the moment
the cap is set (torch imported, gloo initialised: ~0.7 GB of mapped libraries and thread stacks
that hold almost no memory) plus ``--cap-mb``; threads get 2 MiB stacks and malloc one arena, so
reservations that hold no memory stay out of the budget. An allocation past it fails at once (torch raises
``RuntimeError: ... can't allocate memory``). The table reports, per stage, peak RSS and peak
address space above that baseline against the budget and against the stage's ideal share.
Why ``RLIMIT_AS`` rather than a cgroup: it needs no privileges and fails the allocation itself
(a cgroup would OOM-kill the process), so the single-process failure is an exception the worker
can report; see docs/too_big.md.

    python scripts/bench_too_big.py --control                  # defaults: 303M params, 1600 MiB cap
    python scripts/bench_too_big.py --n-layer 8 --n-embd 384 --n-head 8 --cap-mb 110 --resume-layouts 8x1
    python scripts/bench_too_big.py --json-out runs/too_big.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))

#: fp32 weight + gradient + AdamW exp_avg + exp_avg_sq
STATE_BYTES_PER_PARAM = 16
MB = 1 << 20
#: The exit status of a worker that hit the cap and reported it (not a crash).
EXIT_OUT_OF_MEMORY = 3


@dataclass(kw_only=True)
class Setup:
    """One experiment: the model, the batch, the cap and the layouts."""

    n_layer: int = 24
    n_embd: int = 1024
    n_head: int = 16
    block_size: int = 32
    global_batch_size: int = 4
    micro_batch_size: int = 1
    cap_mb: float = 1600.0
    """Memory a process may use above its baseline (torch + gloo), in MiB."""
    pipeline_depth: int = 4
    resume_layouts: tuple[tuple[int, int], ...] = ((8, 1), (4, 2))
    """Where the checkpoint is resumed: another stage split (8x1), and the training run's stages
    twice over (4x2: each stage loads its whole state beside its freshly initialised weights)."""
    save_at: int = 2
    steps: int = 4
    lr: float = 1e-3
    timeout_s: float = 900.0
    shard: bool = False
    """Optimizer state sharded over each stage's replicas (issue #32; ``bench_sharding.py --largest``)."""
    time_balanced: bool = False
    """Keep the time-balanced split even where it overflows a stage's memory (the engine before
    the memory-aware split, issue #32): ``pipeline.stage_memory`` set out of reach."""

    @property
    def cap_bytes(self) -> int:
        return int(self.cap_mb * MB)


# ---------------------------------------------------------------------------------------------
# The model and its sizes (no memory: everything on meta)


def build_meta_model(s: Setup):
    """The GPT example with ``s``'s sizes on the meta device (no storage)."""
    import torch
    from model import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=256,
        block_size=s.block_size,
        n_layer=s.n_layer,
        n_head=s.n_head,
        n_embd=s.n_embd,
        dropout=0.1,
    )
    with torch.device("meta"):
        return GPT(cfg)


def batch_for(step: int, s: Setup):
    """The mini-batch of ``step``: a pure function of the step, so a resumed run sees the same data."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 256, (s.global_batch_size, s.block_size + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def block_activation_bytes(s: Setup) -> int:
    """Bytes autograd saves for one block's backward on one micro-batch (counted on meta)."""
    import torch
    from model import Block, GPTConfig

    cfg = GPTConfig(block_size=s.block_size, n_layer=1, n_head=s.n_head, n_embd=s.n_embd, dropout=0.1)
    seen: dict[int, int] = {}
    with torch.device("meta"):
        block = Block(cfg)
        x = torch.empty(s.micro_batch_size, s.block_size, s.n_embd, requires_grad=True)
    weights = {id(p) for p in block.parameters()}

    def pack(t):
        # Weights (and their transposed views) are saved too, but they are the stage's state.
        if id(t) not in weights and (t._base is None or id(t._base) not in weights):
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


def model_summary(s: Setup) -> dict:
    """Parameter count and training-state bytes of the whole model, and the activation terms."""
    model = build_meta_model(s)
    n = sum(p.numel() for p in model.parameters())
    boundary = s.micro_batch_size * s.block_size * s.n_embd * 4
    return {
        "params": n,
        "state_bytes": n * STATE_BYTES_PER_PARAM,
        "block_activation_bytes": block_activation_bytes(s),
        "boundary_bytes": boundary,
        "logits_bytes": s.micro_batch_size * s.block_size * 256 * 4,
    }


def ideal_share(params: int, blocks: int, last: bool, s: Setup, summary: dict) -> dict:
    """A stage's ideal memory: its parameters' training state plus an activation estimate.

    Activations (varuna schedule, recompute): one micro-batch's graph through the stage's blocks,
    plus every micro-batch's boundary input stashed for recompute (an upper bound), plus the
    logits and their softmax on the last stage."""
    nm = s.global_batch_size // s.micro_batch_size
    act = blocks * summary["block_activation_bytes"] + nm * summary["boundary_bytes"]
    if last:
        act += 3 * summary["logits_bytes"]
    return {
        "state": params * STATE_BYTES_PER_PARAM,
        "activations": act,
        "total": params * STATE_BYTES_PER_PARAM + act,
    }


# ---------------------------------------------------------------------------------------------
# Worker (one rank; also the single-process attempt)


def proc_status() -> dict[str, int]:
    """This process's VmSize, VmPeak, VmRSS, VmHWM in bytes (from /proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmSize", "VmPeak", "VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def cap_address_space(budget: int) -> dict[str, int]:
    """Limit this process's address space to what it maps now plus ``budget`` bytes.

    Call it after torch is imported and the process group exists: their libraries and thread
    stacks are mapped but hold little memory, and are the same for any model size. Returns the
    baseline and the cap."""
    _reset_peak_rss()
    base = proc_status()
    cap = base["VmSize"] + budget
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return {"base_vm": base["VmSize"], "base_rss": base["VmRSS"], "cap_vm": cap}


def _reset_peak_rss() -> None:
    """Start VmHWM afresh, so the peak the report reads is this run's, not the warm-up's.

    Not ``ru_maxrss``: Linux carries it across ``execve`` from the process that forked this one
    (a test runner holding 500 MiB made every rank look 245 MiB over its baseline). Writing 5 to
    ``clear_refs`` resets the high-water mark (Linux >= 4.0); where it cannot, VmHWM includes the
    warm-up's peak, which only overstates the use."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _tune_malloc() -> None:
    """Keep address space that holds no memory out of the budget (call before any thread starts).

    ``RLIMIT_AS`` counts reservations: glibc gives every thread an 8 MiB stack and may give a
    thread that allocates its own 64 MiB heap arena, though each uses a few pages. The engine
    and gloo start 15-25 threads, so those would take ~150-300 MiB of the budget without using
    memory. One arena and 2 MiB stacks leave the limit measuring allocations (the main thread's
    stack is not affected)."""
    import ctypes

    libc = ctypes.CDLL(None)
    M_ARENA_MAX = -8
    libc.mallopt(M_ARENA_MAX, 1)
    # A fixed threshold: blocks of 1 MiB and more (tensors) are mapped and unmapped, so freed
    # memory leaves the process; glibc's adaptive one would move them onto the heap, whose holes
    # stay resident and make the peak RSS creep from step to step.
    M_MMAP_THRESHOLD = -3
    libc.mallopt(M_MMAP_THRESHOLD, MB)
    attr = ctypes.create_string_buffer(256)  # pthread_attr_t is 56 bytes on x86-64 glibc
    if (
        libc.pthread_attr_init(attr) == 0
        and libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(2 * MB)) == 0
    ):
        libc.pthread_setattr_default_np(attr)
        libc.pthread_attr_destroy(attr)


def _peaks() -> tuple[int, int]:
    st = proc_status()
    return st["VmHWM"], st["VmPeak"]


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure under the cap (torch's CPU allocator or Python's)."""
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "DefaultCPUAllocator" in str(e))
    )


def _warm_up(splits: bool) -> None:
    """Import what the engine imports lazily and, when the model will be split (P > 1: rank 0
    counts FLOPs, every rank traces for hidden dependencies), count FLOPs once: its first use
    loads ~75 MB of torch's Python machinery whatever the model, which the baseline should hold
    (measured: without it, the ranks that split took 72 MB more above their baseline)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import varuna.cutting.tracer
    import varuna.runtime.engine
    import varuna.testing.netem  # noqa: F401

    if splits:
        with FlopCounterMode(display=False):
            torch.ones(2, 2) @ torch.ones(2, 2)


def _build_engine(a: argparse.Namespace, s: Setup):
    """The engine over the meta-built model: it materialises this rank's stage (and resumes)."""
    import torch

    import varuna

    # The checkpointer's default snapshot mode ("auto") sees the cap and writes saves from the
    # live tensors: a host copy would not fit (docs/checkpoints.md, "How a save works").
    return varuna.Engine(
        build_meta_model(s),
        varuna.VarunaConfig(
            global_batch_size=s.global_batch_size,
            micro_batch_size=s.micro_batch_size,
            pipeline_depth=a.pipeline_depth,
            seed=0,
            checkpoints=varuna.CheckpointConfig(dir=a.ckpt, resume=a.resume),
            stop_signals=(),
            timeouts=varuna.TimeoutConfig(peer_s=120.0, comm_s=s.timeout_s),
            optimizer_state=varuna.OptimizerStateConfig(shard=s.shard),
            pipeline=varuna.PipelineConfig(stage_memory=1 << 60 if s.time_balanced else None),
        ),
        example_batch=batch_for(1, s),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=s.lr, eps=1e-6),
    )


def _stage_report(engine, rank: int, progress: dict) -> dict:
    blocks = sum(1 for n in engine.stage_params if n.startswith("blocks.") and n.endswith("ln1.weight"))
    return {
        "status": "ok",
        "rank": rank,
        "stage": engine.stage,
        "P": engine.layout.P,
        "D": engine.layout.D,
        "stage_ranges": engine.stage_ranges,
        "params": sum(p.numel() for p in engine.stage_params.values()),
        "blocks": blocks,
        "last_stage": engine.is_last_stage,
        "snapshot_in_memory": getattr(engine.checkpointer, "last_snapshot_in_memory", True),
        "threads": len(os.listdir("/proc/self/task")),
        "peak_rss": proc_status()["VmHWM"],
        **progress,
    }


def worker(a: argparse.Namespace) -> int:
    """One rank of a run (or the lone process of the single-process attempt); writes rank<r>.json."""
    _tune_malloc()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    s = Setup(**json.loads(a.setup))
    report = Path(a.out) / f"rank{os.environ.get('RANK', '0')}.json"
    rank = int(os.environ.get("RANK", "0"))
    _warm_up(splits=a.pipeline_depth > 1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    base = cap_address_space(s.cap_bytes)
    progress: dict = {"phase": "building the stage", "losses": [], "peaks": []}
    t0 = time.perf_counter()
    try:
        engine = _build_engine(a, s)
        progress["first_step"] = engine.step_count + 1
        progress["peaks"].append(["built" + (" + resumed" if engine.step_count else ""), *_peaks()])
        for step in range(engine.step_count + 1, a.steps + 1):
            progress["phase"] = f"training step {step}"
            r = engine.train_step(batch_for(step, s))
            progress["losses"].append([step, r.loss])
            progress["peaks"].append([f"step {step}", *_peaks()])
            if step == a.save_at:
                progress["phase"] = f"checkpointing step {step}"
                engine.save_checkpoint(wait=True)
                progress["peaks"].append([f"saved {step}", *_peaks()])
        engine.checkpointer.wait()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        first_line = str(e).strip().splitlines()[0][:300]
        error = f"{type(e).__name__}: {first_line}"
        report.write_text(
            json.dumps(
                {
                    **progress,
                    "status": "out of memory",
                    "error": error,
                    "seconds": time.perf_counter() - t0,
                    **base,
                    **proc_status(),
                }
            )
        )
        print(f"rank {rank}: out of memory while {progress['phase']}: {first_line}", flush=True)
        return EXIT_OUT_OF_MEMORY
    progress["seconds"] = time.perf_counter() - t0
    report.write_text(json.dumps({**_stage_report(engine, rank, progress), **base, **proc_status()}))
    engine.close()
    return 0


# ---------------------------------------------------------------------------------------------
# Orchestration


def _worker_args(
    s: Setup, out: Path, ckpt: Path, *, P: int, steps: int, save_at: int, resume: str
) -> list[str]:
    return [
        "--worker",
        "--setup",
        json.dumps(asdict(s)),
        "--out",
        str(out),
        "--ckpt",
        str(ckpt),
        "--pipeline-depth",
        str(P),
        "--steps",
        str(steps),
        "--save-at",
        str(save_at),
        "--resume",
        resume,
    ]


def single_process(s: Setup, work: Path, cap_mb: float | None = None) -> dict:
    """The single-process attempt under the cap (or ``cap_mb``): the worker's report, or how it died."""
    s1 = Setup(**{**asdict(s), "cap_mb": cap_mb if cap_mb is not None else s.cap_mb})
    out = work / f"single-{int(s1.cap_mb)}"
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "VARUNA_PIPELINE_DEPTH")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    args = _worker_args(s1, out, work / "ckpt-single", P=1, steps=1, save_at=0, resume="0")
    try:
        proc = subprocess.run(
            [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=s.timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "returncode": None}
    report = out / "rank0.json"
    if report.exists():
        return {**json.loads(report.read_text()), "returncode": proc.returncode}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return {"status": "crashed", "returncode": proc.returncode, "error": " | ".join(tail)}


def pipelined(
    s: Setup, work: Path, name: str, *, P: int, D: int, steps: int, save_at: int, resume: str
) -> list[dict]:
    """A P×D run of the workers (every rank under the cap); each rank's report."""
    from varuna.testing.emulated import run_local_world

    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    args = _worker_args(s, out, work / "ckpt", P=P, steps=steps, save_at=save_at, resume=resume)
    return run_local_world(__file__, args, P * D, out, s.timeout_s, what=f"{name} ({P}x{D})")


def run_experiment(s: Setup, work: Path, *, control: bool = False) -> dict:
    """Everything the table shows: sizes, the single-process attempt, the P-stage run, the resume.

    ``control``: also run the single process with a cap large enough for the whole model (it must
    succeed, so a failure under the cap is the cap's doing)."""
    summary = model_summary(s)
    t = time.perf_counter()
    single = single_process(s, work)
    single["wall_s"] = time.perf_counter() - t
    result: dict = {"setup": asdict(s), "model": summary, "single": single}
    if control:
        roomy = 2 * summary["state_bytes"] / MB + s.cap_mb
        t = time.perf_counter()
        result["control"] = {
            **single_process(s, work, cap_mb=roomy),
            "cap_mb": roomy,
            "wall_s": time.perf_counter() - t,
        }
    t = time.perf_counter()
    trained = pipelined(
        s, work, "train", P=s.pipeline_depth, D=1, steps=s.steps, save_at=s.save_at, resume="0"
    )
    result["train"] = {
        "wall_s": time.perf_counter() - t,
        "stages": [_stage_row(r, s, summary) for r in trained],
    }
    result["resumes"] = []
    for P2, D2 in s.resume_layouts:
        t = time.perf_counter()
        resumed = pipelined(s, work, f"resume-{P2}x{D2}", P=P2, D=D2, steps=s.steps, save_at=0, resume="1")
        result["resumes"].append(
            {
                "wall_s": time.perf_counter() - t,
                "stages": [_stage_row(r, s, summary) for r in resumed],
                "losses": _compare_losses(trained, resumed),
            }
        )
    return result


def _stage_row(r: dict, s: Setup, summary: dict) -> dict:
    ideal = ideal_share(r["params"], r["blocks"], r["last_stage"], s, summary)
    return {
        **r,
        "ideal": ideal,
        "rss_used": r["peak_rss"] - r["base_rss"],
        "vm_used": r["VmPeak"] - r["base_vm"],
        "under_cap": r["VmPeak"] <= r["cap_vm"] and r["peak_rss"] - r["base_rss"] <= s.cap_bytes,
    }


def _compare_losses(trained: list[dict], resumed: list[dict]) -> list[dict]:
    """Per step after the checkpoint: the continued run's loss and the resumed run's (every rank
    reports the agreed loss; rank 0's is used)."""
    cont = {st: loss for st, loss in trained[0]["losses"]}
    back = {st: loss for st, loss in resumed[0]["losses"]}
    rows = []
    for st in sorted(back):
        c, b = cont.get(st), back[st]
        rows.append(
            {
                "step": st,
                "continued": c,
                "resumed": b,
                "abs_diff": None if c is None else abs(c - b),
                "rel_diff": None if c is None else abs(c - b) / max(abs(c), 1e-30),
            }
        )
    return rows


def _stage_table(title: str, run: dict, cap: float) -> list[str]:
    rows = run["stages"]
    lines = [
        "",
        f"{title} at P={rows[0]['P']} D={rows[0]['D']} ({run['wall_s']:.0f} s):",
        "",
        "| rank | stage | segments | params (M) | ideal share: state + act. (MiB) | peak RSS − base (MiB) "
        "| peak VM − base (MiB) | cap (MiB) | under cap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first, last = r["stage_ranges"][r["stage"]]
        i = r["ideal"]
        lines.append(
            f"| {r['rank']} | {r['stage']} | {first}–{last} | {r['params'] / 1e6:.1f} | "
            f"{i['state'] / MB:.0f} + {i['activations'] / MB:.0f} = {i['total'] / MB:.0f} | "
            f"{r['rss_used'] / MB:.0f} | {r['vm_used'] / MB:.0f} | {cap:.0f} | "
            f"{'yes' if r['under_cap'] else 'NO'} |"
        )
    return lines


def _single_line(what: str, r: dict) -> str:
    verdict = "trains" if r.get("status") == "ok" else "fails"
    where = f", {r['phase']}: {r['error']}" if r.get("status") != "ok" and "phase" in r else ""
    return f"{what}: {verdict} ({r.get('status')}{where}; {r.get('wall_s', 0):.0f} s)"


def format_table(res: dict) -> str:
    """The report as Markdown."""
    s, m = res["setup"], res["model"]
    cap = s["cap_mb"]
    lines = [
        f"model: GPT example, {s['n_layer']} blocks, n_embd {s['n_embd']}, block {s['block_size']}, "
        f"M {s['global_batch_size']}, m {s['micro_batch_size']}: {m['params'] / 1e6:.1f}M params; "
        f"fp32 weights + grads + AdamW = {m['state_bytes'] / MB:.0f} MiB = "
        f"{m['state_bytes'] / MB / cap:.2f}x the cap of {cap:.0f} MiB per process (above its baseline)",
        _single_line("one process under the cap", res["single"]),
    ]
    if "control" in res:
        lines.append(
            _single_line(f"control, one process with {res['control']['cap_mb']:.0f} MiB", res["control"])
        )
    lines += _stage_table("trained", res["train"], cap)
    for run in res["resumes"]:
        lines += _stage_table(f"resumed from the checkpoint of step {s['save_at']}", run, cap)
    lines += [
        "",
        "loss of the steps after the checkpoint: the training run going on vs each resumed run",
        "",
        "| step | continued (P×D) | resumed (P×D) | loss, continued | loss, resumed | abs. diff "
        "| rel. diff |",
        "|---|---|---|---|---|---|---|",
    ]
    t0 = res["train"]["stages"][0]
    for run in res["resumes"]:
        r0 = run["stages"][0]
        for row in run["losses"]:
            c = "—" if row["continued"] is None else f"{row['continued']:.9g}"
            d = "—" if row["abs_diff"] is None else f"{row['abs_diff']:.3g}"
            rd = "—" if row["rel_diff"] is None else f"{row['rel_diff']:.3g}"
            lines.append(
                f"| {row['step']} | {t0['P']}×{t0['D']} | {r0['P']}×{r0['D']} | {c} | "
                f"{row['resumed']:.9g} | {d} | {rd} |"
            )
    return "\n".join(lines)


def parse_layout(text: str) -> tuple[int, int]:
    """``"8x1"`` -> (8, 1).

    >>> parse_layout("8x1")
    (8, 1)
    """
    try:
        P, D = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad layout {text!r}; write PxD, e.g. 8x1") from None
    if P < 1 or D < 1:
        raise argparse.ArgumentTypeError(f"bad layout {text!r}: P and D must be >= 1")
    return P, D


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = Setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=d.n_layer)
    p.add_argument("--n-embd", type=int, default=d.n_embd)
    p.add_argument("--n-head", type=int, default=d.n_head)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--global-batch-size", type=int, default=d.global_batch_size)
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    p.add_argument(
        "--cap-mb",
        type=float,
        default=d.cap_mb,
        help="memory each process may use above its torch+gloo baseline (MiB)",
    )
    p.add_argument("--pipeline-depth", type=int, default=d.pipeline_depth, help="P of the training run")
    p.add_argument(
        "--resume-layouts",
        type=lambda t: tuple(parse_layout(x) for x in t.split(",")),
        default=d.resume_layouts,
        help="comma-separated PxD layouts that resume the checkpoint",
    )
    p.add_argument("--save-at", type=int, default=d.save_at, help="checkpoint after this step")
    p.add_argument(
        "--steps", type=int, default=d.steps, help="last step of the continued and the resumed run"
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="also run one process with room for the whole model (must succeed)",
    )
    p.add_argument(
        "--workdir", type=Path, help="where checkpoints and reports go (default: a temporary directory)"
    )
    p.add_argument("--json-out", type=Path)
    # Worker mode (spawned by the above).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setup", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--resume", default="0", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a.worker and not 1 <= a.save_at < a.steps:
        p.error("--save-at must be >= 1 and below --steps (the steps after it are compared)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    s = Setup(
        n_layer=a.n_layer,
        n_embd=a.n_embd,
        n_head=a.n_head,
        block_size=a.block_size,
        global_batch_size=a.global_batch_size,
        micro_batch_size=a.micro_batch_size,
        cap_mb=a.cap_mb,
        pipeline_depth=a.pipeline_depth,
        resume_layouts=a.resume_layouts,
        save_at=a.save_at,
        steps=a.steps,
    )
    with tempfile.TemporaryDirectory(prefix="varuna-too-big-") as tmp:
        work = a.workdir or Path(tmp)
        res = run_experiment(s, work, control=a.control)
    res["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(format_table(res))
    print(f"\nmachine: {os.cpu_count()} cores; {res['uptime']}")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
