"""A real one-host Slurm cluster for the Slurm tests: munge with a key made on the spot, one
slurmctld and two slurmd (nodes ``n1`` and ``n2``, both at 127.0.0.1 on ports of their own),
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, ``SlurmUser=root``, every piece of
state and every log under one temporary directory, the configuration reached through
``$SLURM_CONF`` (nothing under /etc is read or written).

Debian's ``slurm-wlm`` (22.05) and ``munge`` packages provide the daemons and the client commands
(``scripts/setup.sh --tests`` installs them). :func:`why_not_available` says in one line why the
cluster cannot run here (not root, a binary missing); the tests skip with it.

Every daemon runs in the foreground as a child of the test (``-D``/``-F``) with a parent-death
signal, so it is stopped by its pid on every exit path (:meth:`SlurmCluster.close`), and dies with
the test process if that is killed. The step daemons (``slurmstepd``) double-fork away from slurmd;
:meth:`SlurmCluster.close` cancels every job first, waits for them to end (bounded), and kills any
``slurmstepd`` still running with this cluster's ``SLURM_CONF`` in its environment, by pid.

Example::

    with SlurmCluster(tmp_path) as cluster:
        print(cluster.run("sinfo", "-h", "-o", "%N %t").stdout)   # n[1-2] idle
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from varuna.core.process import pdeathsig_prefix  # noqa: E402
from varuna.launch.procs import pdeathsig_preexec  # noqa: E402

NODES = ("n1", "n2")
CPUS_PER_NODE = 2
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")
START_TIMEOUT_S = 60.0
#: Job credential lifetime. A requeued job may start again only this long after it was stopped
#: (a node refuses a job whose credential it revoked: "Job credential revoked"), so Slurm's
#: default, 120 s, would be two minutes of every requeue test; Slurm accepts 5 and more.
CRED_EXPIRE_S = 10


def why_not_available() -> str | None:
    """Why a Slurm cluster cannot be started here (one line), or None."""
    if os.geteuid() != 0:
        return "the Slurm tests run slurmd as root (SlurmUser=root); run them as root"
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return (f"Slurm/munge not installed ({', '.join(missing)} missing); "
                "apt-get install slurm-wlm munge (scripts/setup.sh --tests)")
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.2) -> Any:
    """Poll ``condition`` until it returns something true; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


class SlurmCluster:
    """munged + slurmctld + slurmd ×2 on this host; use as a context manager."""

    def __init__(self, base: Path) -> None:
        self.base = Path(base)
        self.conf = self.base / "slurm.conf"
        self.munge_socket = self.base / "munge" / "munge.socket"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if key != "SLURM_CONF":
                del self.env[key]  # a test run inside a real allocation must not leak into this one

    # -- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._write_config()
        self._start_munge()
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", [_binary("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        wait_for(self._all_idle, START_TIMEOUT_S, f"nodes {', '.join(NODES)} idle ({self.log_tail()})")

    def close(self) -> None:
        """Cancel every job, stop every daemon by pid, kill leftover step daemons: on every path."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError, AssertionError):
                jobs = self.job_ids()
                if jobs:
                    self.run("scancel", "--full", "--quiet", *jobs, check=False)
                    wait_for(lambda: not self.job_ids(), 60, "every job to end")
        for name in reversed(list(self._daemons)):
            proc = self._daemons[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self._daemons.clear()
        for pid in self.stepd_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # -- commands ------------------------------------------------------------------------------

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        env = {**self.env, **kwargs.pop("env", {})}
        return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout,
                              check=check, **kwargs)

    def job_ids(self) -> list[str]:
        out = self.run("squeue", "-h", "-o", "%i", check=False).stdout
        return out.split()

    def job_state(self, job_id: str) -> str:
        """``RUNNING``, ``PENDING``, ``COMPLETED``, ... (``scontrol show job``), '' when unknown."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        for token in out.split():
            if token.startswith("JobState="):
                return token.split("=", 1)[1]
        return ""

    def job_field(self, job_id: str, name: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        for token in out.split():
            if token.startswith(f"{name}="):
                return token.split("=", 1)[1]
        return ""

    def stepd_pids(self) -> list[int]:
        """``slurmstepd`` processes of this cluster (its SLURM_CONF in their environment)."""
        pids = []
        needle = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if not (entry / "cmdline").read_bytes().startswith(b"slurmstepd"):
                    continue
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def log_tail(self, lines: int = 5) -> str:
        out = []
        for log in sorted(self.base.glob("*.log")):
            text = log.read_text(errors="replace").strip().splitlines()[-lines:]
            out.append(f"{log.name}: " + " | ".join(text))
        return "; ".join(out)

    # -- internals -----------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.base / f"{name}.out", "wb")  # noqa: SIM115 - owned by the daemon's life
        try:
            # The parent-death signal from setpriv, not a preexec_fn: Python between fork and exec
            # in a test process that used the manager's gRPC client can crash the child
            # (varuna/core/process.py).
            prefix = pdeathsig_prefix()
            self._daemons[name] = subprocess.Popen(
                [*prefix, *argv], env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                preexec_fn=None if prefix else pdeathsig_preexec(),
            )
        finally:
            log.close()

    def _start_munge(self) -> None:
        munge_dir = self.base / "munge"
        munge_dir.mkdir(mode=0o700)
        key = munge_dir / "munge.key"
        subprocess.run([_binary("mungekey"), "--create", f"--keyfile={key}"], check=True,
                       capture_output=True, timeout=30)
        key.chmod(0o600)
        self._spawn("munged", [
            _binary("munged"), "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={self.base / 'munged.log'}",
            f"--seed-file={munge_dir / 'munged.seed'}",
        ])
        wait_for(self.munge_socket.exists, START_TIMEOUT_S, "munged's socket")

    def _all_idle(self) -> bool:
        for name, proc in self._daemons.items():
            if proc.poll() is not None:
                out = (self.base / f"{name}.out").read_text(errors="replace").strip().splitlines()
                why = f"{name} exited with code {proc.returncode}: {out[-3:]}"
                raise RuntimeError(f"{why}; {self.log_tail()}")
        result = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def _write_config(self) -> None:
        base = self.base
        (base / "state").mkdir(parents=True)
        for node in NODES:
            (base / f"spool-{node}").mkdir()
        ctld_port = _free_port()
        node_ports = [_free_port() for _ in NODES]
        nodes = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} Port={p} "
            f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN"
            for n, p in zip(NODES, node_ports)
        )
        self.conf.write_text(f"""\
ClusterName=varunatest
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base / 'state'}
SlurmdSpoolDir={base}/spool-%n
SlurmctldPidFile={base / 'slurmctld.pid'}
SlurmdPidFile={base}/slurmd-%n.pid
SlurmctldLogFile={base / 'slurmctld.log'}
SlurmdLogFile={base}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
JobRequeue=1
ReturnToService=2
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
KillWait=30
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
