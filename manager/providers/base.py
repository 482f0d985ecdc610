"""Where VMs come from: the provider interface and its two implementations.

- ``local`` (:mod:`manager.providers.local`): pretend VMs on this machine, one agent process group
  each; ``kill -9`` of that group is a preemption.
- ``azure`` (:mod:`manager.providers.azure`): spot VMs in a virtual machine scale set
  (priority Spot, eviction policy Delete), through azure-identity and azure-mgmt-compute.

The manager calls providers outside its state lock (a cloud call can take seconds), and never
relies on them for liveness: agents' heartbeats decide that; ``gone_vms`` only lets the manager
notice an eviction sooner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from manager.domain.store import VMRecord

__all__ = ["NewVM", "Provider", "ProviderContext", "make_provider"]


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


@dataclass(frozen=True, kw_only=True)
class NewVM:
    """A VM the provider started (or asked for)."""

    vm_id: str
    ref: dict[str, Any] = field(default_factory=dict)
    """Provider-specific handle kept in the state file (pid and start time, instance id...).
    ``{"placeholder": true}``: the real name is learnt when the VM registers (scale sets name
    their instances themselves)."""


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
        were already created for this job). ``type_options``: the pool's VM type for a pool job
        (``vm_type``, ``vm_slowdown`` and the type's ``provider_options``; docs/pool.md). Raises
        ``RuntimeError`` on a provider failure."""
        ...

    def delete_vm(self, vm: VMRecord) -> None:
        """Release the VM (idempotent; a VM that is already gone is fine)."""
        ...

    def gone_vms(self, vms: Sequence[VMRecord]) -> list[str]:
        """The ids among ``vms`` the provider knows no longer exist (evicted, exited)."""
        ...

    def close(self) -> None: ...


def make_provider(name: str, options: Mapping[str, Any], context: ProviderContext) -> Provider:
    """The provider called ``name`` with the job's ``provider_options``; ``ValueError`` if the
    name or an option is wrong."""
    if name == "local":
        from manager.providers.local import LocalProvider, LocalProviderOptions

        return LocalProvider(LocalProviderOptions.from_dict(options), context)
    if name == "azure":
        from manager.providers.azure import AzureProvider, AzureProviderOptions

        return AzureProvider(AzureProviderOptions.from_dict(options), context)
    raise ValueError(f"unknown provider {name!r}; use local or azure")
