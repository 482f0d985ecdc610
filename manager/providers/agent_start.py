"""The command line that starts a manager's agent on a VM: one builder for every provider.

A provider fills an :class:`AgentStart` (where the manager is, the token file's path on the VM,
the VM's name, its notice source...) and runs :func:`agent_argv`'s list its own way: the local
provider as a process, Azure from cloud-init (quoted by :func:`shell_command`).

    >>> argv = agent_argv(AgentStart(python="python3", manager="h:7878", token_file="/t", vm_id="vm1",
    ...                              job_id="j", slots=2, log_dir="/logs"))
    >>> argv[:5]
    ['python3', '-m', 'manager.agent.vm_agent', '--manager', 'h:7878']
    >>> shell_command(["echo", "$VM_NAME", "a b"], expand={"$VM_NAME"})
    'echo "$VM_NAME" \\'a b\\''
"""

from __future__ import annotations

import shlex
from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["AGENT_MODULE", "SCHEDULED_EVENTS_SOURCE", "AgentStart", "agent_argv", "shell_command"]

#: ``python -m`` module of the agent (manager/agent/vm_agent.py).
AGENT_MODULE = "manager.agent.vm_agent"
#: The notice source of Azure's Scheduled Events (manager/agent/scheduled_events.py), which the
#: local provider's pretend VMs poll too when a test serves a recorded document.
SCHEDULED_EVENTS_SOURCE = "manager.agent.scheduled_events:ScheduledEventsClient"


@dataclass(frozen=True, kw_only=True)
class AgentStart:
    """Everything an agent's command line says (``python -m manager.agent.vm_agent --help``)."""

    python: str
    """Interpreter on the VM."""
    manager: str
    """``host:port`` the agent dials."""
    token_file: str
    """The bearer token's file, as a path on the VM."""
    vm_id: str
    job_id: str
    slots: int
    log_dir: str
    heartbeat_interval_s: float = 2.0
    orphan_timeout_s: float = 300.0
    fence_timeout_s: float = 0.0
    """Kill the workers after this long cut off from the manager (its ``--heartbeat-timeout``;
    0: never). Note [Fencing under the manager] in manager/agent/vm_agent.py."""
    silence_probe_after_s: float = 0.0
    """Probe the manager's host after this long without an answer, and fence at once when it does
    not answer (the manager's ``--silence-probe-after``; 0: never)."""
    address: str = ""
    """How other VMs reach this one; empty: the agent finds the address that routes to the manager."""
    tls_ca: str | None = None
    """The CA file, as a path on the VM (TLS), else None."""
    notice_source: str | None = None
    """``module:Class`` the agent polls for eviction notices (the provider's registry entry)."""
    notice_url: str | None = None
    """The notice source's endpoint; None: its default."""
    vm_name: str = ""
    """This VM's name for the notice source; empty: ``vm_id``."""
    approve_notices: bool = False
    standby: int = 0
    """Pre-imported standby workers (Note [Standby] in manager/agent/vm_agent.py)."""
    standby_delay_s: float | None = None
    standby_priority: str | None = None


def agent_argv(start: AgentStart) -> list[str]:
    """The agent's command line (unquoted: a list for ``subprocess`` or :func:`shell_command`)."""
    argv = [
        start.python, "-m", AGENT_MODULE,
        "--manager", start.manager,
        "--token-file", start.token_file,
        "--vm-id", start.vm_id,
        "--job-id", start.job_id,
        "--slots", str(start.slots),
    ]
    if start.address:
        argv += ["--address", start.address]
    argv += [
        "--log-dir", start.log_dir,
        "--heartbeat-interval", f"{start.heartbeat_interval_s:g}",
        "--orphan-timeout", f"{start.orphan_timeout_s:g}",
    ]
    if start.fence_timeout_s > 0:
        argv += ["--fence-timeout", f"{start.fence_timeout_s:g}"]
    if start.silence_probe_after_s > 0:
        argv += ["--silence-probe-after", f"{start.silence_probe_after_s:g}"]
    if start.tls_ca:
        argv += ["--tls-ca", start.tls_ca]
    if start.notice_source:
        argv += ["--notice-source", start.notice_source]
        if start.notice_url:
            argv += ["--notice-url", start.notice_url]
        if start.vm_name:
            argv += ["--vm-name", start.vm_name]
        if start.approve_notices:
            argv.append("--approve-notices")
    if start.standby:
        argv += ["--standby", str(start.standby)]
        if start.standby_delay_s is not None:
            argv += ["--standby-delay", f"{start.standby_delay_s:g}"]
        if start.standby_priority is not None:
            argv += ["--standby-priority", start.standby_priority]
    return argv


def shell_command(argv: list[str], *, expand: Collection[str] = ()) -> str:
    """``argv`` as one shell command, every word quoted except those in ``expand`` (shell
    variables such as ``$VM_NAME``, written as ``"$VM_NAME"``: expanded, never split)."""
    return " ".join(f'"{a}"' if a in expand else shlex.quote(a) for a in argv)
