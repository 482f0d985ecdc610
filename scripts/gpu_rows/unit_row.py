"""Row 8 of the GPU check: the CUDA-only unit tests of the audit (``tests/test_cuda.py``), which skip
without a GPU: on one, every test must run and pass (a skip is a failure there)."""

from __future__ import annotations

import re
import subprocess
import sys

from gpu_rows.common import FAIL, PASS, ROOT, RowResult, log

TESTS = "tests/test_cuda.py"


def row_unit(device: str, timeout_s: float = 240.0) -> RowResult:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", TESTS]
    log(" ".join(["python3", *cmd[1:]]))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    last = lines[-1].strip("= ") if lines else f"no output (exit {proc.returncode})"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    skipped_ok = device != "cuda" or counts.get("skipped", 0) == 0
    ok = proc.returncode == 0 and skipped_ok and (counts.get("passed", 0) > 0 or device != "cuda")
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n", flush=True)
    return RowResult(PASS if ok else FAIL, f"{TESTS}: {last}", {"counts": counts, "exit": proc.returncode})
