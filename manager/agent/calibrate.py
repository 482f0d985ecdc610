"""Calibration on a VM: what an agent runs for a PROFILE order (Note [Calibration at job start]
in :mod:`manager.domain.controller`).

``python -m manager.agent.calibrate OUT_FILE ARGS...`` is ``varuna-profile ARGS --out OUT_FILE``, with a
parent-death signal tied to the agent (``$VARUNA_AGENT_PID``) first, so the profiler and its
worker processes die with their VM's agent exactly as training workers do.
:class:`ProfileRun` is the agent's handle on one such run: it starts it in its own session,
polls it (exit, or the order's timeout: then the whole process group is killed), and turns the
outcome into a :class:`ProfileResult` (the calibration file's content, or one line saying why
there is none) for ``ReportCalibration``.

Nothing here imports gRPC or torch: the runner must stay a plain process (the profiler forks
workers), and the agent must not pay for torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from manager.common.procs import die_with_parent, kill_group, reap

__all__ = [
    "MAX_CALIBRATION_BYTES",
    "ProfileResult",
    "ProfileRun",
    "emulate_slowdown",
    "failure_reason",
    "main",
]

#: Largest calibration file an agent sends back (the manager's gRPC server takes 16 MiB requests).
MAX_CALIBRATION_BYTES = 15 << 20
#: Bound on reaping the killed profiler.
REAP_TIMEOUT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class ProfileResult:
    """The outcome of one profiling run on this VM."""

    ok: bool
    calibration_json: str = ""
    """The file's content (when ok)."""
    error: str = ""
    """One line: why there is no calibration (when not ok)."""
    wall_s: float
    """From the start of the run to its exit (or kill)."""


def failure_reason(log_text: str, exit_code: int) -> str:
    """One line explaining a failed ``varuna-profile`` run from its output and exit code: the
    profiler's own one-line message when it printed one, else the last line of output.

    >>> failure_reason("...\\nvaruna-profile: error: bad --model-arg 'x'\\n", 2)
    "varuna-profile exited with 2: error: bad --model-arg 'x'"
    >>> failure_reason("", -9)
    'varuna-profile was killed by signal 9'
    """
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("varuna-profile: ")]
    detail = said[0].removeprefix("varuna-profile: ") if said else (lines[-1] if lines else "")
    head = (
        f"varuna-profile was killed by signal {-exit_code}"
        if exit_code < 0
        else f"varuna-profile exited with {exit_code}"
    )
    text = f"{head}: {detail}" if detail else head
    return text if len(text) <= 300 else text[:297] + "..."


class ProfileRun:
    """One ``varuna-profile`` run ordered by the manager (see the module docstring).

    ``argv`` are the profiler's arguments without ``--out``; the file and the run's log go to
    ``log_dir`` (``calibration-attempt{N}.json`` / ``.log``)."""

    def __init__(
        self,
        *,
        attempt: int,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        timeout_s: float,
        log_dir: Path,
        python: str,
    ) -> None:
        self.attempt = attempt
        self.timeout_s = timeout_s
        self.out = log_dir / f"calibration-attempt{attempt}.json"
        self.log_path = log_dir / f"calibration-attempt{attempt}.log"
        self.result: ProfileResult | None = None
        self.out.unlink(missing_ok=True)  # a file left by an earlier agent on this VM is not ours
        self._started = time.monotonic()
        self._popen: subprocess.Popen | None = None
        with open(self.log_path, "ab") as log:
            try:
                self._popen = subprocess.Popen(
                    [python, "-m", "manager.agent.calibrate", str(self.out), *argv],
                    cwd=cwd or None,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group: the timeout kills the profiler's workers too
                    close_fds=True,
                )
            except OSError as exc:
                self.result = ProfileResult(ok=False, error=f"cannot start varuna-profile: {exc}", wall_s=0.0)

    @property
    def running(self) -> bool:
        """Whether the run has not ended yet."""
        return self.poll() is None

    def poll(self) -> ProfileResult | None:
        """The result once the run ended (killing it first when past its timeout); None before."""
        if self.result is not None or self._popen is None:
            return self.result
        code = reap(self._popen)
        wall = time.monotonic() - self._started
        if code is None:
            if wall <= self.timeout_s:
                return None
            self.kill()
            self.result = ProfileResult(
                ok=False,
                error=f"varuna-profile did not finish within the profile's timeout_s = {self.timeout_s:g} s "
                "(killed; raise profile.timeout_s or make the profile cheaper)",
                wall_s=wall,
            )
            return self.result
        self.result = self._outcome(code, wall)
        return self.result

    def _outcome(self, code: int, wall: float) -> ProfileResult:
        if code != 0:
            try:
                text = self.log_path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = ""
            return ProfileResult(ok=False, error=failure_reason(text, code), wall_s=wall)
        try:
            size = self.out.stat().st_size
            if size > MAX_CALIBRATION_BYTES:
                return ProfileResult(
                    ok=False,
                    error=f"the calibration file is {size / 2**20:.1f} MiB, more than the "
                    f"{MAX_CALIBRATION_BYTES >> 20} MiB the manager takes; profile fewer micro-batch sizes",
                    wall_s=wall,
                )
            data = self.out.read_text(encoding="utf-8")
        except OSError as exc:
            return ProfileResult(
                ok=False, error=f"varuna-profile exited 0 but {self.out} is unreadable: {exc}", wall_s=wall
            )
        return ProfileResult(ok=True, calibration_json=data, wall_s=wall)

    def kill(self) -> None:
        """Stop the run (its whole process group) if it still runs."""
        if self._popen is not None and self._popen.returncode is None:
            kill_group(self._popen.pid, signal.SIGKILL)
            reap(self._popen, REAP_TIMEOUT_S)


def main(argv: list[str] | None = None) -> int:
    """``python -m manager.agent.calibrate OUT_FILE ARGS...``: varuna-profile ARGS --out OUT_FILE."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print(
            "usage: python -m manager.agent.calibrate OUT_FILE [varuna-profile arguments without --out]",
            file=sys.stderr,
        )
        return 2
    parent = os.environ.get("VARUNA_AGENT_PID", "")
    if parent.isdigit():
        die_with_parent(int(parent))
    from profiler.cli import main as profile

    code = profile([*args[1:], "--out", args[0]])
    if code == 0:
        emulate_slowdown(args[0])
    return code


def emulate_slowdown(path: str) -> None:
    """On a pretend VM of a slower type (``$VARUNA_VM_SLOWDOWN`` > 1, set by the local provider:
    its workers' steps are stretched by that factor) stretch the calibration's compute times
    alike, so that calibrating once per VM type measures each type's emulated speed."""
    slowdown = float(os.environ.get("VARUNA_VM_SLOWDOWN", "1") or 1)
    if slowdown <= 1.0:
        return
    import dataclasses

    from varuna.core.calibration import Calibration, VmType

    cal = Calibration.load(path)
    as_type = dataclasses.replace(cal, types={"vm": VmType(name="vm", speed=1.0 / slowdown)})
    slow = dataclasses.replace(as_type.for_type("vm"), host=cal.host, source=cal.source)
    slow.save(path)


if __name__ == "__main__":
    sys.exit(main())
