"""Pretend VMs on this machine: each is a ``manager.agent.vm_agent`` process in its own session.

A pretend VM is the agent's process group; its workers have a parent-death signal tied to the
agent, so ``kill -9 -PGID`` (the agent's pid) takes the whole VM down at once, like a spot
eviction without notice. The agents deliberately do *not* die with the manager: a restarted
manager finds them again through the pid and start time kept in the state file (Note [Process
identity] in :mod:`manager.common.procs`), and an agent that loses its manager for
``orphan_timeout_s`` exits on its own.

Options (the job spec's ``provider_options``):

``metadata_url``
    Scheduled Events endpoint every agent polls (tests serve a recorded document locally).
``approve_notices``
    Agents approve eviction events once their workers stopped.
``max_created``
    Spot capacity model: at most this many VMs are ever created for the job (unset: no limit),
    so a test decides whether lost VMs come back.
``capacity_file``
    Spot capacity that changes while the job runs: an absolute path to a file holding an integer,
    read at every request for VMs, that takes the place of ``max_created`` (raise the number and
    the manager's next request gets the new VMs: capacity "came back"). A missing or unreadable
    file is a provider error (the manager logs it and retries).
``standby``
    Agents keep pre-imported standby workers for the next generation (default true; see Note
    [Standby] in :mod:`manager.agent.vm_agent`), started ``standby_delay_s`` (1) after a
    generation's first step, importing at ``standby_priority`` (``idle`` or ``normal``).
``python``
    Interpreter for the agents (default: the manager's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from manager.common.procs import alive, process_start_time, reap, terminate_group
from manager.domain.store import VMRecord
from manager.providers.base import NewVM, ProviderContext

__all__ = ["SLOWDOWN_ENV", "LocalProvider", "LocalProviderOptions", "read_capacity"]

#: Environment of a pretend VM of a slower pool type: its workers' steps take this many times as
#: long (the agent's environment, which its workers inherit).
SLOWDOWN_ENV = "VARUNA_VM_SLOWDOWN"

#: SIGTERM → SIGKILL grace when deleting a pretend VM (the agent kills its workers on SIGTERM).
DELETE_GRACE_S = 3.0


@dataclass(frozen=True, kw_only=True)
class LocalProviderOptions:
    """``provider_options`` of a local job (module docstring)."""

    metadata_url: str | None = None
    approve_notices: bool = False
    max_created: int | None = None
    capacity_file: str | None = None
    standby: bool = True
    standby_delay_s: float = 1.0
    standby_priority: str = "idle"
    python: str = sys.executable or "python3"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LocalProviderOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"provider_options: unknown local option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        opts = cls(**dict(data))
        bad = (
            not isinstance(opts.max_created, int)
            or isinstance(opts.max_created, bool)
            or opts.max_created < 0
        )
        if opts.max_created is not None and bad:
            raise ValueError(
                f"provider_options.max_created must be an integer >= 0, got {opts.max_created!r}"
            )
        if opts.capacity_file is not None and (
            not isinstance(opts.capacity_file, str) or not os.path.isabs(opts.capacity_file)
        ):
            raise ValueError(
                f"provider_options.capacity_file must be an absolute path, got {opts.capacity_file!r}"
            )
        if opts.standby_priority not in ("idle", "normal"):
            raise ValueError(
                f"provider_options.standby_priority must be idle or normal, got {opts.standby_priority!r}"
            )
        return opts


def read_capacity(path: str) -> int:
    """The VM count in a ``capacity_file``; ``RuntimeError`` (one line) when it has none."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise RuntimeError(f"capacity_file {path}: {exc.strerror or exc}; write a VM count into it") from None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise RuntimeError(f"capacity_file {path} holds {text[:40]!r}, not a VM count >= 0; write one")
    return value


class LocalProvider:
    """See the module docstring."""

    name = "local"

    def __init__(self, options: LocalProviderOptions, context: ProviderContext) -> None:
        self.options = options
        self.context = context
        # Agents started by this process (reaped here); agents found after a restart are only
        # known by pid and start time.
        self._children: dict[str, subprocess.Popen] = {}

    def create_vms(
        self,
        job_id: str,
        names: Sequence[str],
        slots: int,
        *,
        created_so_far: int,
        type_options: Mapping[str, Any] | None = None,
    ) -> list[NewVM]:
        count = len(names)
        # A pool VM type slower than this machine (docs/pool.md): its workers take this many
        # times as long per step (manager.worker.reporter.attach_to_engine applies it).
        slowdown = float((type_options or {}).get("vm_slowdown", 1.0))
        limit = self.options.max_created
        if self.options.capacity_file:
            limit = read_capacity(self.options.capacity_file)
        if "max_created" in (type_options or {}):
            # A job's VM type with a spot capacity of its own (manager.domain.vm_types); created_so_far
            # then counts the VMs of that type.
            limit = int((type_options or {})["max_created"])
        if limit is not None:
            count = max(0, min(count, limit - created_so_far))
        out: list[NewVM] = []
        for vm_id in names[:count]:
            vm_dir = Path(self.context.state_dir) / job_id / vm_id
            vm_dir.mkdir(parents=True, exist_ok=True)
            argv = self._agent_argv(job_id, vm_id, slots, vm_dir)
            env = dict(os.environ)
            package_root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
            env.pop(SLOWDOWN_ENV, None)
            if slowdown > 1.0:
                env[SLOWDOWN_ENV] = f"{slowdown:g}"
            with open(vm_dir / "agent.log", "ab") as log:
                try:
                    popen = subprocess.Popen(
                        argv,
                        cwd=vm_dir,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        # Its own session: the pretend VM is this process group, and a signal to
                        # the manager's terminal does not reach it.
                        start_new_session=True,
                        close_fds=True,
                    )
                except OSError as exc:
                    raise RuntimeError(f"cannot start the agent of {vm_id}: {exc}") from exc
            self._children[vm_id] = popen
            out.append(
                NewVM(
                    vm_id=vm_id,
                    ref={"pid": popen.pid, "start_time": process_start_time(popen.pid), "dir": str(vm_dir)},
                )
            )
        return out

    def _agent_argv(self, job_id: str, vm_id: str, slots: int, vm_dir: Path) -> list[str]:
        """The command line of a pretend VM's agent."""
        argv = [
            self.options.python,
            "-m",
            "manager.agent.vm_agent",
            "--manager",
            self.context.manager_address,
            "--token-file",
            str(Path(self.context.token_file).resolve()),
            "--vm-id",
            vm_id,
            "--job-id",
            job_id,
            "--slots",
            str(slots),
            "--address",
            "127.0.0.1",
            "--log-dir",
            str(vm_dir),
            "--heartbeat-interval",
            f"{self.context.heartbeat_interval_s:g}",
            "--orphan-timeout",
            f"{self.context.orphan_timeout_s:g}",
        ]
        if self.context.tls_ca:
            argv += ["--tls-ca", str(Path(self.context.tls_ca).resolve())]
        if self.options.metadata_url:
            argv += ["--metadata-url", self.options.metadata_url, "--vm-name", vm_id]
        if self.options.approve_notices:
            argv.append("--approve-notices")
        if self.options.standby:
            argv += [
                "--standby",
                str(slots),
                "--standby-delay",
                f"{self.options.standby_delay_s:g}",
                "--standby-priority",
                self.options.standby_priority,
            ]
        return argv

    def delete_vm(self, vm: VMRecord) -> None:
        child = self._children.pop(vm.vm_id, None)
        ref = vm.ref
        if child is not None:
            if reap(child) is None:
                terminate_group(child.pid, None, DELETE_GRACE_S)
                reap(child, DELETE_GRACE_S)
            return
        pid = int(ref.get("pid", 0) or 0)
        if pid:
            terminate_group(pid, ref.get("start_time"), DELETE_GRACE_S)

    def gone_vms(self, vms: Sequence[VMRecord]) -> list[str]:
        gone: list[str] = []
        for vm in vms:
            child = self._children.get(vm.vm_id)
            if child is not None:
                if reap(child) is not None:  # exited (and reaped: no zombie left behind)
                    del self._children[vm.vm_id]
                    gone.append(vm.vm_id)
                continue
            pid = int(vm.ref.get("pid", 0) or 0)
            if pid and not alive(pid, vm.ref.get("start_time")):
                gone.append(vm.vm_id)
        return gone

    def kill(self, vm: VMRecord, sig: int = signal.SIGKILL) -> None:
        """Signal the whole pretend VM (tests: SIGKILL = eviction without notice)."""
        pid = int(vm.ref.get("pid", 0) or 0)
        if pid and alive(pid, vm.ref.get("start_time")):
            os.killpg(pid, sig)

    def close(self) -> None:
        # Agents outlive the manager on purpose (module docstring); only reap the exited ones.
        for vm_id, child in list(self._children.items()):
            if reap(child) is not None:
                del self._children[vm_id]
