"""Run a worker script as P×D real processes (gloo on 127.0.0.1) for multi-process tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(script: Path, world: int, args: list[str], *, env: dict | None = None,
              timeout_s: float = 240, extra_env_per_rank=None) -> list[subprocess.CompletedProcess]:
    """Start ``world`` processes of ``script``, wait for all (bounded), return their results.

    On timeout or failure every process is killed, so no test leaves processes behind.
    """
    port = free_port()
    procs = []
    for rank in range(world):
        e = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
             "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
        if extra_env_per_rank:
            e.update(extra_env_per_rank(rank))
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return results


def check_ok(results: list[subprocess.CompletedProcess]) -> None:
    bad = [(i, r.returncode, r.stdout[-3000:]) for i, r in enumerate(results) if r.returncode != 0]
    if bad:
        raise AssertionError("worker(s) failed:\n" + "\n".join(f"rank {i} exit {c}:\n{o}" for i, c, o in bad))
