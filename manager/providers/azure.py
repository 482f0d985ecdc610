"""Azure spot VMs in a virtual machine scale set (azure-identity + azure-mgmt-compute).

One scale set per job, Uniform orchestration, every instance ``priority=Spot`` with
``evictionPolicy=Delete`` (an evicted VM disappears instead of lingering deallocated and
billed for its disk) and ``maxPrice=-1`` (pay up to the on-demand price; eviction then only
happens for capacity). A scale set rather than individual VMs because its instance profile
carries the network configuration inline: individual VMs would each need a NIC, i.e. the
network SDK too.

- ``create_vms(n)``: create the scale set on first use, else raise its capacity by ``n``. Azure
  names the instances (``<scale set>_<instance id>``), so the manager records placeholders and
  learns the names when the agents register (each agent asks the Instance Metadata Service for
  its name and polls Scheduled Events for eviction notices).
- ``delete_vm``: ``deleteInstances`` of that instance id.
- ``gone_vms``: list the instances (at most every ``list_interval_s``); a registered VM that is
  no longer listed, or is being deleted, was evicted.

The agent is started by cloud-init from the scale set's ``customData``: it writes the bearer
token to ``/etc/varuna/token`` (mode 600), runs ``setup_command`` (e.g. ``pip install
'varuna[manager]==X'``) and starts ``python3 -m manager.agent.vm_agent``. Note that
``customData`` is readable by anyone who can read the scale set in the subscription; use a
dedicated token per deployment.

Note [One scale set per VM type]: a job with several VM types (``[[vm_types]]``, issue #19) gets
one scale set per type, ``<scale set>-<type>``, created with that type's ``vm_size`` (and
``max_price``, ``image`` when the type sets them): a scale set has one VM size. Instances are
named ``<scale set>-<type>_<n>``, so a registering VM's type is its scale set's.

Everything is reached through the SDK client, so tests replace its HTTP transport (azure-core
``HttpTransport``) with recorded responses: tests/test_manager_azure.py. Nothing here has run
against real Azure from this repository's CI (it has no Azure access).
"""

from __future__ import annotations

import base64
import dataclasses
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from manager.providers.agent_start import SCHEDULED_EVENTS_SOURCE, AgentStart, agent_argv, shell_command
from manager.providers.base import NewVM, ProviderContext, ProviderVM
from manager.providers.registry import ProviderExtra, register_provider

__all__ = ["AZURE_EXTRA", "AzureProvider", "AzureProviderOptions", "agent_custom_data"]

#: What a ``[[vm_types]]`` table may set per type (Note [One scale set per VM type]).
TYPE_OPTION_KEYS = ("vm_size", "max_price", "image")

_IMDS_NAME_URL = "http://169.254.169.254/metadata/instance/compute/name?api-version=2021-02-01&format=text"


@dataclass(frozen=True, kw_only=True)
class AzureProviderOptions:
    """``provider_options`` of an azure job."""

    subscription_id: str
    resource_group: str
    location: str
    vm_size: str
    """e.g. ``Standard_NC24ads_A100_v4``."""
    subnet_id: str
    """Full resource id of the subnet the instances join (the manager must be reachable from it)."""
    ssh_public_key: str
    image: dict[str, str] = field(
        default_factory=lambda: {
            "publisher": "microsoft-dsvm",
            "offer": "ubuntu-hpc",
            "sku": "2204",
            "version": "latest",
        }
    )
    """Image reference (publisher, offer, sku, version)."""
    scale_set: str = ""
    """Scale set name; default ``varuna-<job id>``."""
    admin_username: str = "varuna"
    setup_command: str = "python3 -m pip install --quiet 'varuna[manager]'"
    """Shell command cloud-init runs before starting the agent (installs this package with the
    manager extra: the agent speaks gRPC)."""
    python: str = "python3"
    max_price: float = -1.0
    list_interval_s: float = 30.0
    approve_notices: bool = True

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AzureProviderOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"provider_options: unknown azure option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        required = ("subscription_id", "resource_group", "location", "vm_size", "subnet_id", "ssh_public_key")
        missing = [k for k in required if not data.get(k)]
        if missing:
            raise ValueError(f"provider_options: azure needs {', '.join(missing)}")
        return cls(**dict(data))


def agent_custom_data(
    options: AzureProviderOptions, context: ProviderContext, job_id: str, slots: int, token: str
) -> str:
    """The cloud-init script (base64, as ``customData`` wants it) that starts the agent."""
    q = shlex.quote
    argv = agent_argv(AgentStart(
        python=options.python,
        manager=context.manager_address,
        token_file="/etc/varuna/token",
        vm_id="$VM_NAME",  # Azure names the instance: learnt at boot, below
        job_id=job_id,
        slots=slots,
        log_dir="/var/log/varuna",
        heartbeat_interval_s=context.heartbeat_interval_s,
        orphan_timeout_s=context.orphan_timeout_s,
        fence_timeout_s=context.fence_timeout_s,  # Note [Fencing under the manager]
        silence_probe_after_s=context.silence_probe_after_s,
        tls_ca="/etc/varuna/ca.pem" if context.tls_ca else None,
        notice_source=SCHEDULED_EVENTS_SOURCE,
        approve_notices=options.approve_notices,
        standby=slots,
    ))
    cmd = shell_command(argv, expand={"$VM_NAME"})  # $VM_NAME must expand: quote everything else
    lines = [
        "#!/bin/bash",
        "set -euo pipefail",
        "install -d -m 700 /etc/varuna /var/log/varuna",
        f"(umask 077; printf '%s' {q(token)} > /etc/varuna/token)",
    ]
    if context.tls_ca:
        with open(context.tls_ca, encoding="utf-8") as f:
            lines.append(f"printf '%s' {q(f.read())} > /etc/varuna/ca.pem")
    lines += [
        options.setup_command,
        f"VM_NAME=$(curl -sf --noproxy '*' -H Metadata:true {q(_IMDS_NAME_URL)})",
        f"nohup {cmd} >> /var/log/varuna/agent.log 2>&1 &",
    ]
    return base64.b64encode(("\n".join(lines) + "\n").encode("utf-8")).decode("ascii")


#: What needs the azure extra, as its one-line error names it.
AZURE_WHAT = "the azure provider (on the manager's host)"
#: The azure extra (pyproject.toml): the SDK this module reaches through ``client``.
AZURE_EXTRA = ProviderExtra(
    name="azure",
    packages={"azure.identity": "azure-identity", "azure.mgmt.compute": "azure-mgmt-compute"},
    what=AZURE_WHAT,
)


@register_provider(
    name="azure",
    options=AzureProviderOptions,
    extra=AZURE_EXTRA,
    type_options=TYPE_OPTION_KEYS,
    notice_source=SCHEDULED_EVENTS_SOURCE,
)
class AzureProvider:
    """See the module docstring. ``client`` (a ``ComputeManagementClient``) and ``credential``
    are for tests and special set-ups; by default ``DefaultAzureCredential`` is used."""

    name = "azure"

    def __init__(
        self,
        options: AzureProviderOptions,
        context: ProviderContext,
        *,
        client: Any = None,
        token: str | None = None,
    ) -> None:
        if client is None:  # one line naming the pip install, not an ImportError at the first tick
            AZURE_EXTRA.require()
        self.options = options
        self.context = context
        self._client = client
        self._token = token
        self._last_list = 0.0
        self._listed: dict[str, str] = {}  # instance name -> provisioning state
        self._scale_set_exists: bool | None = None

    # -- SDK plumbing --------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            from azure.identity import DefaultAzureCredential
            from azure.mgmt.compute import ComputeManagementClient

            self._client = ComputeManagementClient(DefaultAzureCredential(), self.options.subscription_id)
        return self._client

    def _scale_set_name(self, job_id: str) -> str:
        return self.options.scale_set or f"varuna-{job_id}"[:64]

    def _read_token(self) -> str:
        if self._token is None:
            from manager.common.wire import load_token

            self._token = load_token(self.context.token_file)
        return self._token

    def _typed(self, job_id: str, type_options: Mapping[str, Any] | None) -> tuple[AzureProviderOptions, str]:
        """The options and scale set for VMs of a type (Note [One scale set per VM type])."""
        if not type_options or not type_options.get("vm_type"):
            return self.options, self._scale_set_name(job_id)
        overrides = {k: v for k, v in type_options.items() if k in TYPE_OPTION_KEYS}
        vm_type = re.sub(r"[^A-Za-z0-9-]", "-", str(type_options["vm_type"]))
        name = f"{self._scale_set_name(job_id)[: 63 - len(vm_type)]}-{vm_type}"
        return dataclasses.replace(self.options, **overrides), name

    def scale_set_model(
        self, job_id: str, slots: int, capacity: int, options: AzureProviderOptions | None = None
    ) -> Any:
        """The scale set to create: spot instances, eviction policy Delete, the agent in customData."""
        from azure.mgmt.compute import models as m

        o = options or self.options
        profile = m.VirtualMachineScaleSetVMProfile(
            priority="Spot",
            eviction_policy="Delete",
            billing_profile=m.BillingProfile(max_price=o.max_price),
            os_profile=m.VirtualMachineScaleSetOSProfile(
                computer_name_prefix="varuna",
                admin_username=o.admin_username,
                custom_data=agent_custom_data(o, self.context, job_id, slots, self._read_token()),
                linux_configuration=m.LinuxConfiguration(
                    disable_password_authentication=True,
                    ssh=m.SshConfiguration(
                        public_keys=[
                            m.SshPublicKey(
                                path=f"/home/{o.admin_username}/.ssh/authorized_keys",
                                key_data=o.ssh_public_key,
                            )
                        ]
                    ),
                ),
            ),
            storage_profile=m.VirtualMachineScaleSetStorageProfile(
                image_reference=m.ImageReference(**o.image),
                os_disk=m.VirtualMachineScaleSetOSDisk(create_option="FromImage", caching="ReadWrite"),
            ),
            network_profile=m.VirtualMachineScaleSetNetworkProfile(
                network_interface_configurations=[
                    m.VirtualMachineScaleSetNetworkConfiguration(
                        name="varuna-nic",
                        primary=True,
                        ip_configurations=[
                            m.VirtualMachineScaleSetIPConfiguration(
                                name="varuna-ip", subnet=m.ApiEntityReference(id=o.subnet_id)
                            )
                        ],
                    )
                ]
            ),
        )
        return m.VirtualMachineScaleSet(
            location=o.location,
            sku=m.Sku(name=o.vm_size, tier="Standard", capacity=capacity),
            upgrade_policy=m.UpgradePolicy(mode="Manual"),
            orchestration_mode="Uniform",
            overprovision=False,  # extra instances would register as VMs we never asked for
            single_placement_group=False,
            virtual_machine_profile=profile,
            tags={"varuna-job": job_id},
        )

    # -- Provider interface --------------------------------------------------------------------

    def create_vms(
        self,
        job_id: str,
        names: Sequence[str],
        slots: int,
        *,
        created_so_far: int,
        type_options: Mapping[str, Any] | None = None,
    ) -> list[NewVM]:
        from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
        from azure.mgmt.compute import models as m

        o, name = self._typed(job_id, type_options)
        count = len(names)
        if count == 0:
            return []
        try:
            try:
                current = self.client.virtual_machine_scale_sets.get(o.resource_group, name)
            except ResourceNotFoundError:
                current = None
            if current is None:
                # polling=False: the instances register themselves when they boot; waiting for the
                # long-running operation here would only hold up the manager.
                self.client.virtual_machine_scale_sets.begin_create_or_update(
                    o.resource_group, name, self.scale_set_model(job_id, slots, count, o), polling=False
                )
            else:
                capacity = int((current.sku.capacity if current.sku else 0) or 0) + count
                self.client.virtual_machine_scale_sets.begin_update(
                    o.resource_group,
                    name,
                    m.VirtualMachineScaleSetUpdate(
                        sku=m.Sku(name=o.vm_size, tier="Standard", capacity=capacity)
                    ),
                    polling=False,
                )
        except HttpResponseError as exc:
            raise RuntimeError(
                f"azure: cannot grow scale set {name}: {exc.message or exc}".splitlines()[0]
            ) from exc
        return [NewVM(vm_id=n, ref={"placeholder": True, "scale_set": name}) for n in names]

    def delete_vm(self, vm: ProviderVM) -> None:
        from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
        from azure.mgmt.compute import models as m

        ref = vm.ref
        if ref.get("placeholder"):
            return  # never materialised as a known instance; capacity shrinks with evictions
        scale_set = ref.get("scale_set") or self._scale_set_name(vm.job_id)
        instance_id = ref.get("instance_id") or vm.vm_id.rsplit("_", 1)[-1]
        try:
            self.client.virtual_machine_scale_sets.begin_delete_instances(
                self.options.resource_group,
                scale_set,
                m.VirtualMachineScaleSetVMInstanceRequiredIDs(instance_ids=[instance_id]),
                polling=False,
            )
        except ResourceNotFoundError:
            pass
        except HttpResponseError as exc:
            raise RuntimeError(
                f"azure: cannot delete {vm.vm_id}: {exc.message or exc}".splitlines()[0]
            ) from exc

    def list_instances(self, job_id: str, scale_set: str | None = None) -> dict[str, str]:
        """``{instance name: provisioning state}`` of the job's scale set (or ``scale_set``, one
        VM type's; empty if it does not exist)."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            return {
                vm.name: str((vm.provisioning_state if hasattr(vm, "provisioning_state") else "") or "")
                for vm in self.client.virtual_machine_scale_set_vms.list(
                    self.options.resource_group, scale_set or self._scale_set_name(job_id)
                )
            }
        except ResourceNotFoundError:
            return {}

    def gone_vms(self, vms: Sequence[ProviderVM]) -> list[str]:
        known = [vm for vm in vms if not vm.ref.get("placeholder") and vm.state == "up"]
        if not known or time.monotonic() - self._last_list < self.options.list_interval_s:
            return []
        self._last_list = time.monotonic()
        scale_sets = {vm.ref.get("scale_set") or self._scale_set_name(vm.job_id) for vm in known}
        self._listed = {}
        for scale_set in sorted(scale_sets):  # one per VM type of the job
            self._listed.update(self.list_instances(known[0].job_id, scale_set))
        return [
            vm.vm_id
            for vm in known
            if vm.vm_id not in self._listed or self._listed[vm.vm_id].lower() == "deleting"
        ]

    def close(self) -> None:
        if self._client is not None and hasattr(self._client, "close"):
            self._client.close()
