"""Row 7 of the GPU check: ``varuna-profile`` (``python3 -m profiler.cli``) calibrates the GPT example
on the device: compute per segment and m on the GPU, memory from the CUDA allocator's peak
(profiler/compute.py), links and all-reduce between two emulated hosts on loopback (no network
namespaces needed). The calibration must load, name the GPU, and have positive times and
activation memory that grows with m; its FLOP count per example must be there for MFU."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_rows.common import FAIL, PASS, ROOT, RowResult, log, sizes

#: Runs ``python -m profiler.cli ARGS`` after asking the kernel to kill it with this row's process.
_BOOT = ("import os, runpy, sys\nfrom varuna.core.process import die_with_parent\n"
         "die_with_parent(int(sys.argv[1]))\nsys.argv = ['varuna-profile', *sys.argv[2:]]\n"
         "runpy.run_module('profiler.cli', run_name='__main__')\n")


def _command(z: dict, device: str, out: Path) -> list[str]:
    keys = ("n_layer", "n_head", "n_embd", "block_size")
    model_args = [a for k in keys for a in ("--model-arg", f"{k}={z[k]}")]
    return ["--model", "examples/gpt2/profile_target.py:build", *model_args, "--micro-batch-sizes", z["ms"],
            "--device", device, "--procs", "2", "--hosts", "2", "--procs-per-host", "2",
            "--host-emulation", "loopback", "--reps", "3", "--warmup", "1", "--link-reps", "3",
            "--allreduce-reps", "2", "--out", str(out), "--quiet"]


def _judge(cal, device: str, wall: float) -> RowResult:
    source = (cal.profiler or {}).get("memory_source")
    segs, ms = cal.segments, cal.micro_batch_sizes
    times_ok = all(s.fwd_s[j].median > 0 and s.bwd_s[j].median > 0 for s in segs for j in range(len(ms)))
    grows = all(s.activation_bytes[-1] > s.activation_bytes[0] > 0 for s in segs)
    flops = cal.model.fwd_flops_per_example or []
    want_source = "cuda_allocator" if device == "cuda" else "saved_tensors"
    named = device != "cuda" or "cuda" in cal.host.device
    ok = times_ok and grows and source == want_source and named and sum(flops) > 0
    mib = [(s.activation_bytes[0] / 2**20, s.activation_bytes[-1] / 2**20) for s in segs]
    act = ", ".join(f"{a:.2f}->{b:.2f}" for a, b in mib)
    summary = (f"{wall:.0f} s; host '{cal.host.device}'; memory from {source}; activation MiB at m={ms[0]}->"
               f"{ms[-1]} per segment: {act}; forward {sum(flops) / 1e9:.3g} GFLOP/example")
    return RowResult(PASS if ok else FAIL, summary, {
        "wall_s": wall, "memory_source": source, "host": cal.host.device, "fwd_flops_per_example": flops,
        "fwd_s": [[st.median for st in s.fwd_s] for s in segs],
        "activation_bytes": [s.activation_bytes for s in segs]})


def row_profile(device: str, timeout_s: float = 300.0) -> RowResult:
    from varuna.core.calibration import Calibration

    z = sizes(device, "profile")
    with tempfile.TemporaryDirectory(prefix="gpu-check-profile-") as tmp:
        out = Path(tmp) / "calibration.json"
        args = _command(z, device, out)
        log("python3 -m profiler.cli " + " ".join(args))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _BOOT, str(os.getpid()), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return RowResult(FAIL, f"varuna-profile exited {proc.returncode}: {' | '.join(tail)}",
                             {"stderr": proc.stderr[-4000:], "stdout": proc.stdout[-2000:]})
        return _judge(Calibration.load(out), device, wall)
