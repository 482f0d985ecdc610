"""Pretend VMs on this machine: each is a ``manager.agent.vm_agent`` process in its own session.

A pretend VM is the agent's process group; its workers have a parent-death signal tied to the
agent, so ``kill -9 -PGID`` (the agent's pid) takes the whole VM down at once, like a spot
eviction without notice. The agents deliberately do *not* die with the manager: a restarted
manager finds them again through the pid and start time kept in the state file (Note [Process
identity] in :mod:`manager.common.procs`), and an agent that loses its manager for
``orphan_timeout_s`` exits on its own.

Options (the job spec's ``provider_options``):

``metadata_url``
    Scheduled Events endpoint every agent polls (tests serve a recorded document locally): the
    notice source this provider declares is Azure's (:data:`SCHEDULED_EVENTS_SOURCE`).
``notice_source``
    Which notice source the agents poll at ``metadata_url``: a provider's name (``aws``: the
    agents read AWS IMDS ``spot/instance-action``) or a ``module:Class``
    (``manager.agent.gcp_metadata:PreemptedClient``: GCP's ``preempted``); default: this
    provider's own (Azure's Scheduled Events), so tests play any cloud's metadata service.
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
``keep_deleted``
    A delete that does not take effect (default false): the manager's delete of a pretend VM
    leaves it running, as a cloud whose API call was lost, or that cannot reach a partitioned VM
    before it is gone for good. Tests of fencing (Note [Fencing under the manager] in
    manager/agent/vm_agent.py): the agent's own silence rule must then stop its workers.
``netns``
    Network namespaces to start the pretend VMs in, one VM per namespace at a time (Note [VMs in
    namespaces]): a list of names such as :class:`varuna.testing.netns.NetHosts` builds. A VM
    takes the first namespace in which no agent runs; with none free, no VM is created (the
    capacity model of a fixed set of hosts). Needs root; the manager must listen on an address
    the namespaces reach (run it in the set's control namespace, ``--listen 10.214.0.254:PORT``).

Note [VMs in namespaces]
~~~~~~~~~~~~~~~~~~~~~~~~
With ``netns`` a pretend VM is a real network host: its agent and workers run inside their own
namespace, with its own address (the agent advertises the address that routes to the manager),
and reach the manager, the live store and each other over the set's links. So a fault that makes
a host *silent* (:meth:`varuna.testing.netns.NetHosts.blackhole`: packets vanish, no reset
arrives) reaches the manager as it does in a cloud: heartbeats stop, the survivors' peers stop
answering, while every process keeps running. Which namespace is free is read from the kernel
(``ip netns pids`` and the processes' command lines), not remembered, so a restarted manager
does not place a second VM beside a running agent. Deleting a VM signals its agent's process
group as without ``netns`` (a provider's delete reaches a partitioned VM: the cloud's API does
not go through the VM's network).

A job spec is refused when its pretend VMs would run more workers than this machine takes
(:func:`check_local_capacity`, the registry's ``check_job``). This module is also the worked
example of adding a provider (docs/manager.md, "Adding a provider").
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from manager.common.procs import alive, process_start_time, reap, terminate_group
from manager.providers.agent_start import AGENT_MODULE, SCHEDULED_EVENTS_SOURCE, AgentStart, agent_argv
from manager.providers.base import NewVM, ProviderContext, ProviderVM
from manager.providers.registry import JobShape, provider_entry, register_provider
from varuna.launch.spec import default_max_procs_per_host

__all__ = ["SLOWDOWN_ENV", "LocalProvider", "LocalProviderOptions", "check_local_capacity", "read_capacity"]

#: Environment of a pretend VM of a slower pool type: its workers' steps take this many times as
#: long (the agent's environment, which its workers inherit).
SLOWDOWN_ENV = "VARUNA_VM_SLOWDOWN"

#: SIGTERM → SIGKILL grace when deleting a pretend VM (the agent kills its workers on SIGTERM).
DELETE_GRACE_S = 3.0


@dataclass(frozen=True, kw_only=True)
class LocalProviderOptions:
    """``provider_options`` of a local job (module docstring)."""

    metadata_url: str | None = None
    notice_source: str | None = None
    approve_notices: bool = False
    max_created: int | None = None
    capacity_file: str | None = None
    standby: bool = True
    standby_delay_s: float = 1.0
    standby_priority: str = "idle"
    python: str = sys.executable or "python3"
    netns: tuple[str, ...] = ()
    keep_deleted: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LocalProviderOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"provider_options: unknown local option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        values = dict(data)
        if "netns" in values:
            values["netns"] = _namespaces(values["netns"])
        opts = cls(**values)
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
        if opts.notice_source is not None:
            _notice_source(opts.notice_source)  # ValueError: one line
        if opts.standby_priority not in ("idle", "normal"):
            raise ValueError(
                f"provider_options.standby_priority must be idle or normal, got {opts.standby_priority!r}"
            )
        return opts


def _notice_source(value: Any) -> str:
    """``provider_options.notice_source`` as ``module:Class``: a provider's name stands for the
    source its registry entry declares."""
    if isinstance(value, str) and ":" in value and all(value.partition(":")[::2]):
        return value
    try:
        source = provider_entry(value).notice_source if isinstance(value, str) else None
    except ValueError as exc:
        raise ValueError(f"provider_options.notice_source: {exc}; or name a module:Class") from None
    if source is None:
        raise ValueError(f"provider_options.notice_source {value!r} names no notice source; use a provider "
                         "that has one, or a module:Class")
    return source


_NETNS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _namespaces(value: Any) -> tuple[str, ...]:
    """``provider_options.netns`` checked: a list of namespace names (``ValueError``, one line)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"provider_options.netns must be a list of network namespace names, got {value!r}")
    bad = [n for n in value if not _NETNS_NAME.match(n)]
    if bad:
        raise ValueError(f"provider_options.netns: {bad[0]!r} is not a namespace name (letters, digits, ._-)")
    if len(set(value)) != len(value):
        raise ValueError("provider_options.netns names a namespace twice; one VM per namespace")
    return tuple(value)


def _agents_in(namespace: str) -> bool:
    """Whether an agent runs in ``namespace`` (Note [VMs in namespaces])."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30,
                         check=False).stdout
    for pid in out.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if AGENT_MODULE.encode() in cmdline:
            return True
    return False


def check_local_capacity(job: JobShape) -> None:
    """Pretend VMs are processes on this machine (an agent and ``procs_per_vm`` workers each):
    bound them as ``varuna-launch`` bounds workers per host (``ValueError``, one line)."""
    created = job.options.get("max_created")
    vms = min(job.max_vms, created) if isinstance(created, int) and created >= 0 else job.max_vms
    limit = default_max_procs_per_host()
    if vms * job.procs_per_vm > limit:
        raise ValueError(
            f"the {job.provider} provider would run {vms} × {job.procs_per_vm} workers on this machine, more "
            f"than its limit of {limit} (4 × its CPU cores, at least 8); lower max_vms (or set "
            "provider_options.max_created)"
        )


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


@register_provider(
    name="local",
    options=LocalProviderOptions,
    type_options=("max_created",),
    notice_source=SCHEDULED_EVENTS_SOURCE,
    check_job=check_local_capacity,
)
class LocalProvider:
    """See the module docstring."""

    name = "local"

    def __init__(self, options: LocalProviderOptions, context: ProviderContext) -> None:
        self.options = options
        self.context = context
        # Agents started by this process (reaped here); agents found after a restart are only
        # known by pid and start time.
        self._children: dict[str, subprocess.Popen] = {}
        self._netns_of: dict[str, str] = {}  # Note [VMs in namespaces]

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
        free: list[str] = []
        if self.options.netns:  # Note [VMs in namespaces]
            if not hasattr(os, "geteuid") or os.geteuid() != 0:
                raise RuntimeError("provider_options.netns needs a manager running as root (ip netns exec);"
                                   " run it as root or drop the option")
            # Also those of agents this process just started (``ip netns exec`` may not have
            # exec'd the agent yet).
            held = {self._netns_of.get(v) for v, c in self._children.items() if c.poll() is None}
            free = [n for n in self.options.netns if n not in held and not _agents_in(n)]
            count = min(count, len(free))
        out: list[NewVM] = []
        for i, vm_id in enumerate(names[:count]):
            vm_dir = Path(self.context.state_dir) / job_id / vm_id
            vm_dir.mkdir(parents=True, exist_ok=True)
            start = self.agent_start(job_id, vm_id, slots, vm_dir)
            if free:  # the agent finds its own address: the one that routes to the manager
                start = dataclasses.replace(start, address="")
            argv = agent_argv(start)
            if free:
                argv = ["ip", "netns", "exec", free[i], *argv]  # exec: the agent keeps this pid
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
            if free:
                self._netns_of[vm_id] = free[i]
            out.append(
                NewVM(
                    vm_id=vm_id,
                    ref={"pid": popen.pid, "start_time": process_start_time(popen.pid), "dir": str(vm_dir),
                         **({"netns": free[i]} if free else {})},
                )
            )
        return out

    def agent_start(self, job_id: str, vm_id: str, slots: int, vm_dir: Path) -> AgentStart:
        """What a pretend VM's agent is started with: the notice source is the one this provider's
        registry entry declares (a provider built on pretend VMs, registered under its own name,
        gets its own; it may change the rest with ``dataclasses.replace``)."""
        o, c = self.options, self.context
        return AgentStart(
            python=o.python,
            manager=c.manager_address,
            token_file=str(Path(c.token_file).resolve()),
            vm_id=vm_id,
            job_id=job_id,
            slots=slots,
            address="127.0.0.1",
            log_dir=str(vm_dir),
            heartbeat_interval_s=c.heartbeat_interval_s,
            orphan_timeout_s=c.orphan_timeout_s,
            fence_timeout_s=c.fence_timeout_s,
            silence_probe_after_s=c.silence_probe_after_s,
            tls_ca=str(Path(c.tls_ca).resolve()) if c.tls_ca else None,
            notice_source=self._notice_source() if o.metadata_url else None,
            notice_url=o.metadata_url,
            vm_name=vm_id,
            approve_notices=o.approve_notices,
            standby=slots if o.standby else 0,
            standby_delay_s=o.standby_delay_s,
            standby_priority=o.standby_priority,
        )

    def _notice_source(self) -> str | None:
        """``notice_source``'s class, default this provider's own (its registry entry)."""
        if self.options.notice_source:
            return _notice_source(self.options.notice_source)
        return provider_entry(self.name).notice_source

    def delete_vm(self, vm: ProviderVM) -> None:
        if self.options.keep_deleted:
            return  # the module docstring: a delete that does not take effect
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

    def gone_vms(self, vms: Sequence[ProviderVM]) -> list[str]:
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

    def kill(self, vm: ProviderVM, sig: int = signal.SIGKILL) -> None:
        """Signal the whole pretend VM (tests: SIGKILL = eviction without notice)."""
        pid = int(vm.ref.get("pid", 0) or 0)
        if pid and alive(pid, vm.ref.get("start_time")):
            os.killpg(pid, sig)

    def close(self) -> None:
        # Agents outlive the manager on purpose (module docstring); only reap the exited ones.
        for vm_id, child in list(self._children.items()):
            if reap(child) is not None:
                del self._children[vm_id]
