"""Process helpers shared by the per-VM agent and the local provider (Linux process groups).
The parent-death signal and free-port helpers are :mod:`varuna.launch.procs`'s.

Note [Process identity]: a pid alone does not identify a process across a manager restart: the
old one may have exited and the pid been reused. We record the pid together with its start time
(``/proc/PID/stat`` field 22, clock ticks since boot), which together are unique for the life of
the machine, and only signal a pid whose start time still matches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

# One implementation of each for the launcher and the manager; find_free_port is part of this
# module's API (the VM agent and the demo scripts import it from here).
from varuna.core.process import die_with_parent
from varuna.launch.procs import find_free_port

__all__ = [
    "alive",
    "find_free_port",
    "kill_group",
    "die_with_parent",
    "process_start_time",
    "reap",
    "restore_normal_priority",
    "terminate_group",
    "wait_gone",
]


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when no such process exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces or ')'; fields after
    # the last ')' are plain numbers: state is field 3, starttime field 22.
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        if rest[0] == b"Z":  # a zombie has exited; only its parent's wait is missing
            return None
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def alive(pid: int, start_time: int | None) -> bool:
    """Whether the process ``pid`` started at ``start_time`` still runs (Note [Process identity])."""
    if pid <= 0:
        return False
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def kill_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when it no longer exists."""
    if pgid <= 0:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def reap(popen: subprocess.Popen, timeout_s: float = 0.0) -> int | None:
    """If the child ``popen`` has exited (waiting up to ``timeout_s`` for it), kill what it left
    in its process group, reap it and return its exit code; None while it still runs.

    The check uses ``waitid(WNOWAIT)``, which leaves the zombie in place: while it exists its pid
    (the group id) cannot be reused, so the group SIGKILL reaches only the child's leftovers.
    Never call ``popen.poll()``/``wait()`` first: they reap, and the group kill could then hit
    a process that reused the pid.
    """
    if popen.returncode is not None:
        return popen.returncode
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere: the exit code is lost, the group is not ours
            return popen.poll()
        if info is not None:
            break
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)
    kill_group(popen.pid, signal.SIGKILL)
    try:
        return popen.wait(timeout=1.0)  # a zombie: returns at once
    except subprocess.TimeoutExpired:
        return None


def restore_normal_priority(pid: int = 0) -> int:
    """Put every thread of process ``pid`` (0: this one) back to SCHED_OTHER (from the SCHED_IDLE
    of a standby worker, see :mod:`manager.worker.shim`). Returns the threads that could not be
    changed (gone meanwhile, or no permission)."""
    failed = 0
    task_dir = f"/proc/{pid or 'self'}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            failed += 1
    return failed


def wait_gone(pid: int, start_time: int | None, timeout_s: float) -> bool:
    """Poll until ``pid`` (not our child) has exited; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid, start_time):
            return True
        time.sleep(0.02)
    return not alive(pid, start_time)


def terminate_group(pgid: int, start_time: int | None, grace_s: float) -> None:
    """SIGTERM the group led by ``pgid`` (if its leader is still the process we started), then
    SIGKILL whatever remains after ``grace_s``."""
    if not alive(pgid, start_time):
        return
    kill_group(pgid, signal.SIGTERM)
    if not wait_gone(pgid, start_time, grace_s):
        kill_group(pgid, signal.SIGKILL)
        wait_gone(pgid, start_time, 2.0)
    # Members of the group other than the leader, if the leader already exited. The kernel never
    # hands out a pid equal to a live group's id, so this cannot reach an unrelated process.
    kill_group(pgid, signal.SIGKILL)
