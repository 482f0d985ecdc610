"""``python -m manager.worker.shim [-m] SCRIPT ARGS...``: run an unmodified training script as a
manager-supervised worker.

The manager's agents start every worker through this shim. It runs ``SCRIPT`` exactly as
``python SCRIPT ARGS`` would (as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` set the
same way). When run by the manager (``$VARUNA_MANAGER`` set) it adds the engine plugins of
:data:`ENGINE_PLUGINS` to ``$VARUNA_ENGINE_PLUGINS`` (varuna/runtime/plugins.py), so every
``varuna.Engine`` the script builds, once built,

- applies ``$VARUNA_CHECKPOINT_EVERY`` when the script leaves ``checkpoint_every`` at 0, so the
  job spec bounds how many steps a lost VM costs without the script knowing about it, and
- gets a :class:`manager.worker.reporter.WorkerReporter` (one heartbeat per step to the manager, through
  ``engine.add_step_callback``): :func:`manager.worker.reporter.attach_to_engine`;
- receives a stop asked for while the worker was starting (Note [Early stop]).

Nothing is patched: the engine calls the plugins through its public hooks, and scripts without
torch pay nothing. Scripts that report by themselves (``WorkerReporter.from_env``) can be
launched the same way: they get the reporter already attached, and each step is reported once.

With ``$VARUNA_AGENT_PID`` set (the agent sets it) the shim first asks the kernel to kill the
worker when the agent dies (:func:`manager.common.procs.die_with_parent`).

Note [Early stop]: a SIGUSR1 ("checkpoint and stop", e.g. an eviction notice) that arrives before
the engine installed its own handler must neither kill the worker (the manager would count a
failure) nor be lost. Until then the shim's handler only remembers it; the plugin
:func:`release_early_stop` then asks the engine to stop (it does, with a checkpoint, after its first
step). The signal is never blocked: a script that installs its own SIGUSR1 handler (or never builds
an engine) gets every signal as it would without the shim. The memory is one object per process
because signal handlers are per process; ``python -m manager.worker.shim`` runs this module under
its importable name, so the plugin the engine imports by name sees the same object.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import sys
import threading
from pathlib import Path
from typing import IO, Any

__all__ = ["ENGINE_PLUGINS", "enable_engine_plugins", "main", "release_early_stop", "standby"]

#: Engine plugins (``module:function``) that make a ``varuna.Engine`` a managed worker.
ENGINE_PLUGINS = ("manager.worker.shim:release_early_stop", "manager.worker.reporter:attach_to_engine")


def enable_engine_plugins(environ: dict[str, str] | None = None) -> None:
    """Add :data:`ENGINE_PLUGINS` to ``$VARUNA_ENGINE_PLUGINS`` in ``environ`` (default
    ``os.environ``), after any plugins already named there.

    Example::

        >>> env = {"VARUNA_ENGINE_PLUGINS": "mine:attach"}
        >>> enable_engine_plugins(env)
        >>> env["VARUNA_ENGINE_PLUGINS"].split(",")[0]
        'mine:attach'
    """
    env = os.environ if environ is None else environ
    current = [e.strip() for e in env.get("VARUNA_ENGINE_PLUGINS", "").split(",") if e.strip()]
    env["VARUNA_ENGINE_PLUGINS"] = ",".join(current + [p for p in ENGINE_PLUGINS if p not in current])


class _EarlyStop:
    """SIGUSR1 handler during start-up: remembers the request (Note [Early stop])."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    def __call__(self, signum: int, frame: Any) -> None:
        self.requested.set()


#: The process's start-up SIGUSR1 memory (Note [Early stop]: signal handlers are per process).
_EARLY_STOP = _EarlyStop()


def _hold_early_stop() -> None:
    """Note [Early stop]: remember a SIGUSR1 until :func:`release_early_stop` hands it on. A live
    run's notice signal (``$VARUNA_LIVE_NOTICE_SIGNAL``, e.g. SIGUSR2, whose default action ends
    the process) is ignored until the script's ``LiveTrainer`` takes it: the manager orders a
    hand-over only once the generation trains, and a worker that never took it is just lost."""
    signal.signal(signal.SIGUSR1, _EARLY_STOP)
    notice = os.environ.get("VARUNA_LIVE_NOTICE_SIGNAL", "")
    if notice.startswith("SIG") and notice != "SIGUSR1" and hasattr(signal, notice):
        signal.signal(getattr(signal, notice), signal.SIG_IGN)


def release_early_stop(engine: Any) -> None:
    """Engine plugin: hand a stop asked for during start-up to ``engine`` (Note [Early stop]).

    Example::

        VARUNA_ENGINE_PLUGINS=manager.worker.shim:release_early_stop python train.py
    """
    if _EARLY_STOP.requested.is_set():
        engine.stop_requested = True


#: What a standby worker imports ahead of time (``$VARUNA_STANDBY_PRELOAD`` overrides): torch and
#: the engine, and ``torch._dynamo``, which torch imports lazily during the engine's dry run and
#: which alone takes seconds of CPU.
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "varuna.runtime.engine")


def standby(stdin: IO[bytes] | None = None) -> int:
    """``--standby``: import the heavy modules now, then wait for one job on stdin and run it.

    The agent keeps one standby per slot so a morph's new workers skip their imports (the bulk of
    a worker's start-up on a small VM). The job is one JSON line ``{"argv": [...], "env": {...},
    "cwd": "...", "log": "..."}``: the process then takes exactly that environment, directory and
    output file, and runs like ``python -m manager.worker.shim ARGV``. EOF: exit 0 unused.
    """
    _die_with_agent()
    # Importing is seconds of CPU. With $VARUNA_STANDBY_PRIORITY=idle (the agent's default) it
    # runs at idle priority, so a standby never slows the running generation; on a VM whose CPU
    # the training keeps busy it then makes little progress until it is needed. Only where we
    # can restore the normal priority afterwards (root): a worker must not train at idle
    # priority. The agent restores it the moment it hands over a job (an idle process on a busy
    # VM might not even get to read its stdin), and we do again once we read it.
    idle = os.environ.get("VARUNA_STANDBY_PRIORITY", "idle") == "idle" and _set_idle_priority()
    names = os.environ.get("VARUNA_STANDBY_PRELOAD")
    for name in names.split(",") if names is not None else DEFAULT_PRELOAD:
        if name.strip():
            try:
                importlib.import_module(name.strip())
            except ImportError as exc:  # a preload is an optimisation, never a failure
                print(f"worker_shim: standby: cannot preload {name}: {exc}", file=sys.stderr, flush=True)
    stream = stdin if stdin is not None else sys.stdin.buffer
    # Wait for the agent to hand us a job (or close the pipe), a second at a time: a standby
    # whose agent is gone (the parent-death signal covers that too) must not wait forever.
    agent = os.environ.get("VARUNA_AGENT_PID", "")
    while not select.select([stream], [], [], 1.0)[0]:
        if agent.isdigit() and os.getppid() != int(agent):
            return 0
    line = stream.readline()
    if not line.strip():
        return 0
    if idle:
        _restore_normal_priority()
    job = json.loads(line)
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(job["env"])
    if job.get("cwd"):
        os.chdir(job["cwd"])
    return main(list(job["argv"]))


def _set_idle_priority() -> bool:
    """SCHED_IDLE for this process's threads when we may switch back later (root); True if set."""
    if not hasattr(os, "SCHED_IDLE") or os.geteuid() != 0:
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return True
    except OSError:
        return False


def _restore_normal_priority() -> None:
    """Back to SCHED_OTHER for every thread (threads started while idle inherited SCHED_IDLE)."""
    from manager.common.procs import restore_normal_priority

    if restore_normal_priority():
        print(
            "worker_shim: could not restore the normal priority of every thread", file=sys.stderr, flush=True
        )


def _die_with_agent() -> None:
    agent = os.environ.get("VARUNA_AGENT_PID", "")
    if agent.isdigit():
        # Die with the agent, like the workers of a VM that vanishes (before anything else runs).
        from manager.common.procs import die_with_parent

        die_with_parent(int(agent))


def main(argv: list[str] | None = None) -> int:
    """Run the script; returns only on a usage error (the script's own exit ends the process)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--standby"]:
        return standby()
    module = False
    if args[:1] in (["-m"], ["--module"]):
        module, args = True, args[1:]
    if not args:
        print(
            "worker_shim: error: no SCRIPT given (usage: python -m manager.worker.shim [-m] SCRIPT ARGS...)",
            file=sys.stderr,
        )
        return 2
    _die_with_agent()
    if os.environ.get("VARUNA_MANAGER"):
        _hold_early_stop()
        enable_engine_plugins()
    target, script_args = args[0], args[1:]
    path = Path(target)
    if not module and not path.is_file():
        print(f"worker_shim: error: script {target} does not exist", file=sys.stderr)
        return 2
    code = 0
    try:
        if module:
            sys.argv = [target, *script_args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [str(path), *script_args]
            # As `python SCRIPT` does: the script's directory first on sys.path (replacing ours).
            sys.path[0] = str(path.resolve().parent)
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    finally:
        # The script is done. Python resets signal handlers while it shuts down, and a SIGUSR1
        # then (a stop that raced with the end of training) would kill the worker with a failure
        # code; there is nothing left to checkpoint, so ignore it.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if os.environ.get("VARUNA_SHIM_FAST_EXIT", "1") != "0":
        _fast_exit(code)
    if code:
        raise SystemExit(code)
    return 0


def _exit_code(exc: SystemExit) -> int:
    """The process exit status ``sys.exit(exc.code)`` would give (a message means 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _fast_exit(code: int) -> None:
    """Note [Fast exit]: after the script is done, exit without tearing the interpreter down.

    Tearing down a process that used torch.distributed takes seconds (measured 4-9 s for the GPT
    example's workers on a loaded 2-core VM, in native destructors, after every atexit handler
    ran), and a morph waits for every worker of the stopped generation to exit. So we do what
    matters of Python's shutdown ourselves — wait for non-daemon threads (a checkpoint's
    background copy is one), run the atexit handlers, flush every open file object and stdio —
    and then ``os._exit``. Module teardown and garbage collection, which hold nothing we need,
    are skipped. ``VARUNA_SHIM_FAST_EXIT=0`` restores the normal exit.
    """
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(600.0)  # bounded: a copy that has not finished in 10 minutes is stuck
    atexit._run_exitfuncs()
    for obj in gc.get_objects():
        # Buffered files a script left open would otherwise lose their last writes.
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


if __name__ == "__main__":
    # Run under the importable name, so the engine plugins named in $VARUNA_ENGINE_PLUGINS
    # (imported as manager.worker.shim) share this process's state (Note [Early stop]).
    from manager.worker import shim as worker_shim
    sys.exit(worker_shim.main())
