"""``python -m manager.worker_shim [-m] SCRIPT ARGS...``: run an unmodified training script as a
manager-supervised worker.

The manager's agents start every worker through this shim. It runs ``SCRIPT`` exactly as
``python SCRIPT ARGS`` would (as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` set the
same way), after swapping ``varuna.Engine`` for a subclass that

- applies ``$VARUNA_CHECKPOINT_EVERY`` when the script leaves ``checkpoint_every`` at 0, so the
  job spec bounds how many steps a lost VM costs without the script knowing about it, and
- attaches a :class:`manager.client.WorkerReporter` (one heartbeat per step to the manager).

With ``$VARUNA_AGENT_PID`` set (the agent sets it) the shim first asks the kernel to kill the
worker when the agent dies (:func:`manager.procs.die_with_parent`).

The swap only happens inside this worker process (no file or other process is touched), when
the script imports ``varuna.runtime.engine`` (a meta-path hook: scripts without torch pay nothing); a
script that builds its engine through ``varuna.Engine`` or ``varuna.runtime.engine.Engine`` gets
it. Scripts that
report by themselves (``WorkerReporter.from_env``) can be launched the same way: the subclass
does not attach a second reporter when the engine already has one.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import os
import runpy
import select
import signal
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["ShimState", "install", "main", "standby"]


@dataclass
class ShimState:
    """What the shim shares with the engine subclass it installs (one per worker process)."""

    early_stop: threading.Event = field(default_factory=threading.Event)
    """A SIGUSR1 arrived before the engine installed its own handler (during start-up)."""


def install(state: ShimState | None = None) -> None:
    """Make ``varuna.Engine`` the reporting subclass in this process, as soon as
    ``varuna.runtime.engine`` is imported (now, if it already was). Importing it here would cost every
    worker a torch import even when its script never uses torch."""
    state = state if state is not None else ShimState()
    if "varuna.runtime.engine" in sys.modules:
        _patch(sys.modules["varuna.runtime.engine"], state)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(state))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``varuna.runtime.engine`` like the normal finders do and patches it right after it ran."""

    def __init__(self, state: ShimState) -> None:
        self.state = state

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "varuna.runtime.engine":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            _patch(module, self.state)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch(engine_mod: types.ModuleType, state: ShimState) -> None:
    from manager.client import WorkerReporter

    base = engine_mod.Engine
    if getattr(base, "_varuna_manager_shim", False):
        return

    class ManagedEngine(base):  # type: ignore[misc, valid-type]
        """``varuna.Engine`` plus manager heartbeats and the job's checkpoint interval."""

        _varuna_manager_shim = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            config = kwargs.get("config", args[1] if len(args) > 1 else None)
            every = os.environ.get("VARUNA_CHECKPOINT_EVERY", "")
            if config is not None and every and hasattr(config, "checkpoint_every"):
                if not getattr(config, "checkpoint_every", 0):
                    config.checkpoint_every = int(every)
            super().__init__(*args, **kwargs)
            if state.early_stop.is_set():
                # Asked to stop while starting: stop (checkpoint and exit) after the first step.
                self.stop_requested = True
            if getattr(self, "manager_reporter", None) is None:
                self.manager_reporter = WorkerReporter.from_env(self)

        def train_step(self, batch: Any) -> Any:
            result = super().train_step(batch)
            if self.manager_reporter is not None:
                self.manager_reporter.on_step(result)
            return result

    ManagedEngine.__name__ = ManagedEngine.__qualname__ = "Engine"
    ManagedEngine.__module__ = base.__module__
    engine_mod.Engine = ManagedEngine
    # varuna/__init__ resolves exports lazily through __getattr__, which reads
    # varuna.runtime.engine.Engine at call time: the patched class is what `varuna.Engine` returns.
    varuna_pkg = sys.modules.get("varuna")
    if varuna_pkg is not None and "Engine" in vars(varuna_pkg):
        varuna_pkg.Engine = ManagedEngine


#: What a standby worker imports ahead of time (``$VARUNA_STANDBY_PRELOAD`` overrides): torch and
#: the engine, and ``torch._dynamo``, which torch imports lazily during the engine's dry run and
#: which alone takes seconds of CPU.
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "varuna.runtime.engine")


def standby(stdin: IO[bytes] | None = None) -> int:
    """``--standby``: import the heavy modules now, then wait for one job on stdin and run it.

    The agent keeps one standby per slot so a morph's new workers skip their imports (the bulk of
    a worker's start-up on a small VM). The job is one JSON line ``{"argv": [...], "env": {...},
    "cwd": "...", "log": "..."}``: the process then takes exactly that environment, directory and
    output file, and runs like ``python -m manager.worker_shim ARGV``. EOF: exit 0 unused.
    """
    _die_with_agent()
    state = ShimState()
    if os.environ.get("VARUNA_MANAGER"):
        install(state)
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
    return main(list(job["argv"]), state=state)


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
    from manager.procs import restore_normal_priority

    if restore_normal_priority():
        print(
            "worker_shim: could not restore the normal priority of every thread", file=sys.stderr, flush=True
        )


def _die_with_agent() -> None:
    agent = os.environ.get("VARUNA_AGENT_PID", "")
    if agent.isdigit():
        # Die with the agent, like the workers of a VM that vanishes (before anything else runs).
        from manager.procs import die_with_parent

        die_with_parent(int(agent))


def main(argv: list[str] | None = None, *, state: ShimState | None = None) -> int:
    """Run the script; returns only on a usage error (the script's own exit ends the process)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--standby"]:
        return standby()
    module = False
    if args[:1] in (["-m"], ["--module"]):
        module, args = True, args[1:]
    if not args:
        print(
            "worker_shim: error: no SCRIPT given (usage: python -m manager.worker_shim [-m] SCRIPT ARGS...)",
            file=sys.stderr,
        )
        return 2
    _die_with_agent()
    state = state if state is not None else ShimState()
    if os.environ.get("VARUNA_MANAGER"):
        # Until the engine installs its own handler, a SIGUSR1 ("checkpoint and stop", e.g. an
        # eviction notice during start-up) is remembered and handed to the engine, instead of
        # killing the worker (which the manager would count as a failure).
        signal.signal(signal.SIGUSR1, lambda *_: state.early_stop.set())
        install(state)
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
    sys.exit(main())
