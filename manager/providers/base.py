"""What a provider is: the interface the manager's domain calls (:class:`Provider`), what it is
given (:class:`ProviderContext`), what it returns (:class:`NewVM`) and what it sees of a VM
(:class:`ProviderVM`). Providers declare themselves in :mod:`manager.providers.registry`.

The manager calls providers outside its state lock (a cloud call can take seconds), and never
relies on them for liveness: agents' heartbeats decide that; ``gone_vms`` only lets the manager
notice an eviction sooner.

    >>> NewVM(vm_id="job-vm1", ref={"pid": 42}).ref["pid"]
    42
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["NewVM", "Provider", "ProviderContext", "ProviderVM"]


#: Note [Fencing under the manager]: an agent whose manager's host answers its probes (or that
#: does not probe) fences this long after the manager's T, so that a reply merely slowed by a
#: loaded manager does not kill workers the manager still counts.
FENCE_SLACK_S = 2.0


@dataclass(frozen=True, kw_only=True)
class ProviderContext:
    """What a provider needs to start agents that can reach this manager."""

    manager_address: str
    """``host:port`` agents connect to."""
    token_file: str
    """Path of the token file (local agents read the same file)."""
    tls_ca: str | None = None
    """CA/certificate file agents verify the manager with (TLS), else None."""
    state_dir: str
    """Per-VM directories of the local provider (agent and worker logs)."""
    heartbeat_interval_s: float = 2.0
    orphan_timeout_s: float = 300.0
    heartbeat_timeout_s: float = 15.0
    """The manager's T (a VM silent that long is gone)."""
    silence_probe_after_s: float = 0.0
    """The manager's S: an agent that has had no answer this long probes the manager's host (Note
    [Fencing under the manager] in manager/agent/vm_agent.py); 0: never."""

    @property
    def fence_timeout_s(self) -> float:
        """How long an agent cut off from the manager keeps its workers: T plus
        :data:`FENCE_SLACK_S` (Note [Fencing under the manager] in manager/agent/vm_agent.py)."""
        return self.heartbeat_timeout_s + FENCE_SLACK_S


@dataclass(frozen=True, kw_only=True)
class NewVM:
    """A VM the provider started (or asked for)."""

    vm_id: str
    ref: dict[str, Any] = field(default_factory=dict)
    """Provider-specific handle kept in the state file (pid and start time, instance id...).
    ``{"placeholder": true}``: the real name is learnt when the VM registers (scale sets name
    their instances themselves)."""


class ProviderVM(Protocol):
    """What a provider sees of one of its VMs (the manager's ``VMRecord`` is one)."""

    @property
    def vm_id(self) -> str: ...

    @property
    def job_id(self) -> str: ...

    @property
    def state(self) -> str:
        """``requested``, ``up``, ``gone`` or ``deleted``."""
        ...

    @property
    def ref(self) -> Mapping[str, Any]:
        """The :attr:`NewVM.ref` the provider returned (with ``vm_type`` for a typed VM)."""
        ...


class Provider(Protocol):
    """A source of VMs for one job."""

    name: str

    def create_vms(
        self,
        job_id: str,
        names: Sequence[str],
        slots: int,
        *,
        created_so_far: int,
        type_options: Mapping[str, Any] | None = None,
    ) -> list[NewVM]:
        """Start up to ``len(names)`` VMs (fewer when capacity is short; ``created_so_far`` VMs
        were already created for this job). ``type_options``: the VM type of a pool job or of a
        job with ``[[vm_types]]`` (``vm_type``, ``vm_slowdown`` and the type's
        ``provider_options``; docs/pool.md). Raises ``RuntimeError`` on a provider failure."""
        ...

    def delete_vm(self, vm: ProviderVM) -> None:
        """Release the VM (idempotent; a VM that is already gone is fine)."""
        ...

    def gone_vms(self, vms: Sequence[ProviderVM]) -> list[str]:
        """The ids among ``vms`` the provider knows no longer exist (evicted, exited)."""
        ...

    def close(self) -> None: ...
