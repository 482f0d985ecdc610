"""Calibration over real links, checked against a known cap: ``varuna-profile --host-list`` on hosts
in network namespaces (varuna/testing/netns.py) whose links ``tbf`` caps at R bytes/s each way.

Per rate R one row: the inter-host bandwidth ``varuna-profile`` fitted (the links' latency +
bytes/bandwidth line, ``links.inter``) and the all-reduce bandwidth, each against R; a link
calibrates right when the fitted bandwidth is within 10 % of R (issue #30). The profiler runs in
the set's control namespace and reaches the hosts with OpenSSH as ``varuna-launch --hosts`` does
(Note [Calibrating real links] in profiler/hosts.py): nothing is emulated, the kernel's ``tbf`` is
the only cap.

Usage (root; every namespace, sshd and process is removed on exit)::

    python scripts/calibrate_hosts.py                      # 100 and 400 Mbit/s, 2 hosts
    python scripts/calibrate_hosts.py --rates-mbit 50 --hosts 3

Results and the machine's load when they were taken: docs/profiling.md, "Calibrating real links".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from varuna.core.calibration import Calibration  # noqa: E402
from varuna.testing.netns import NetHosts, netns_unavailable  # noqa: E402
from varuna.testing.sshd import sshd_unavailable  # noqa: E402

MODEL = f"{ROOT / 'examples' / 'gpt2' / 'profile_target.py'}:build"
MODEL_ARGS = ("n_layer=2", "n_embd=64", "n_head=2", "block_size=32")
TOLERANCE = 0.10


def calibrate(net: NetHosts, out: Path, timeout_s: float) -> tuple[Calibration, float]:
    """``varuna-profile --host-list`` over every host of ``net``; the calibration and its wall time."""
    hosts = ",".join(net.address(h) for h in range(net.num_hosts))
    cmd = [sys.executable, "-m", "profiler.cli", "--model", MODEL,
           *[a for arg in MODEL_ARGS for a in ("--model-arg", arg)], "--micro-batch-sizes", "2", "--out",
           str(out), "--host-list", hosts, "--procs-per-host", "2", "--procs", "2", "--quiet",
           *net.ssh_options()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(out.parent)}
    started = time.monotonic()
    run = subprocess.run(net.control(cmd), capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                         env=env)
    if run.returncode != 0:
        raise RuntimeError(f"varuna-profile failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return Calibration.load(out), time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates-mbit", default="100,400", help="tbf caps to check, Mbit/s (default 100,400)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    why = netns_unavailable() or sshd_unavailable()
    if why is not None:
        print(f"calibrate_hosts: cannot run: {why}", file=sys.stderr)
        return 2
    rates = [float(r) for r in a.rates_mbit.split(",") if r]
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    print(f"{'cap Mbit/s':>10} {'cap MB/s':>9} {'inter MB/s':>10} {'err':>7} {'latency ms':>10}"
          f" {'allreduce MB/s':>14} {'err':>7} {'wall s':>7}  ok")
    bad = 0
    for mbit in rates:
        rate = mbit * 1e6 / 8
        with tempfile.TemporaryDirectory(prefix="varuna-cal-hosts-") as tmp, \
                NetHosts.create(a.hosts, workdir=Path(tmp), rate_bytes_per_s=rate) as net:
            cal, wall = calibrate(net, Path(tmp) / "calibration.json", a.timeout)
        inter = cal.inter.bandwidth_bytes_per_s
        ar = cal.allreduce.bandwidth_bytes_per_s
        err, ar_err = inter / rate - 1, ar / rate - 1
        ok = abs(err) <= TOLERANCE
        bad += not ok
        latency_ms = cal.inter.latency_s * 1e3
        print(f"{mbit:>10g} {rate / 1e6:>9.2f} {inter / 1e6:>10.2f} {err:>+7.1%} {latency_ms:>10.3f}"
              f" {ar / 1e6:>14.2f} {ar_err:>+7.1%} {wall:>7.1f}  {'yes' if ok else 'NO'}")
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
