"""The azure provider through the SDK's own transport hook: a ``HttpTransport`` subclass answers
every HTTP request of azure-mgmt-compute with recorded Azure Resource Manager JSON, so the real
SDK builds (and we check) the real requests. No Azure account is involved; see docs/manager.md."""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import dataclass, field

import pytest

pytest.importorskip("azure.mgmt.compute")

from azure.core.credentials import AccessToken, AccessTokenInfo  # noqa: E402
from azure.core.pipeline.transport import HttpTransport  # noqa: E402
from azure.core.rest._http_response_impl import HttpResponseImpl  # noqa: E402
from azure.mgmt.compute import ComputeManagementClient  # noqa: E402

from manager.domain.store import VMRecord  # noqa: E402
from manager.providers.azure import AzureProvider, AzureProviderOptions  # noqa: E402
from manager.providers.base import ProviderContext  # noqa: E402

SUB, RG, SS = "00000000-0000-0000-0000-000000000001", "rg-varuna", "varuna-job1"
BASE = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.Compute/virtualMachineScaleSets/{SS}"

# Recorded (trimmed) ARM responses.
SCALE_SET = {
    "id": BASE,
    "name": SS,
    "type": "Microsoft.Compute/virtualMachineScaleSets",
    "location": "eastus",
    "sku": {"name": "Standard_NC6s_v3", "tier": "Standard", "capacity": 2},
    "properties": {
        "provisioningState": "Succeeded",
        "orchestrationMode": "Uniform",
        "virtualMachineProfile": {
            "priority": "Spot",
            "evictionPolicy": "Delete",
            "billingProfile": {"maxPrice": -1},
        },
    },
}
INSTANCES = {
    "value": [
        {
            "id": f"{BASE}/virtualMachines/0",
            "name": f"{SS}_0",
            "instanceId": "0",
            "properties": {"provisioningState": "Succeeded", "latestModelApplied": True},
        },
        {
            "id": f"{BASE}/virtualMachines/3",
            "name": f"{SS}_3",
            "instanceId": "3",
            "properties": {"provisioningState": "Deleting"},
        },
    ]
}
NOT_FOUND = {
    "error": {
        "code": "ResourceNotFound",
        "message": f"The Resource 'Microsoft.Compute/virtualMachineScaleSets/{SS}' was not found.",
    }
}
QUOTA = {
    "error": {
        "code": "OperationNotAllowed",
        "message": "Operation could not be completed as it results in exceeding approved LowPriorityCores "
        "quota. Additional details...",
    }
}


class _Response(HttpResponseImpl):
    def __init__(self, request, status: int, body) -> None:
        super().__init__(
            request=request,
            internal_response=None,
            status_code=status,
            headers={"Content-Type": "application/json", "x-ms-request-id": "rec"},
            reason="OK" if status < 400 else "Error",
            content_type="application/json",
            stream_download_generator=None,
        )
        self._content = json.dumps(body).encode() if body is not None else b""
        self._is_closed = self._is_stream_consumed = True


@dataclass
class RecordedTransport(HttpTransport):
    """Answers from ``routes`` ((method, path regex) -> (status, body)) and records requests."""

    routes: dict = field(default_factory=dict)
    requests: list = field(default_factory=list)

    def send(self, request, **kwargs):
        path = re.sub(r"^https://management\.azure\.com", "", request.url.split("?")[0])
        body = request.content
        self.requests.append(
            {
                "method": request.method,
                "path": path,
                "auth": request.headers.get("Authorization"),
                "json": json.loads(body) if body else None,
            }
        )
        for (method, pattern), (status, answer) in self.routes.items():
            if method == request.method and re.fullmatch(pattern, path):
                return _Response(request, status, answer)
        return _Response(
            request, 404, {"error": {"code": "NotRecorded", "message": f"{request.method} {path}"}}
        )

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        pass


class _Credential:
    def get_token(self, *scopes, **kwargs) -> AccessToken:
        return AccessToken("recorded-arm-token", int(time.time()) + 3600)

    def get_token_info(self, *scopes, **kwargs) -> AccessTokenInfo:
        return AccessTokenInfo("recorded-arm-token", int(time.time()) + 3600)


def _provider(tmp_path, routes, **options):
    transport = RecordedTransport(routes=routes)
    client = ComputeManagementClient(_Credential(), SUB, transport=transport)
    opts = AzureProviderOptions.from_dict(
        {
            "subscription_id": SUB,
            "resource_group": RG,
            "location": "eastus",
            "vm_size": "Standard_NC6s_v3",
            "subnet_id": f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.Network/"
            "virtualNetworks/v/"
            "subnets/default",
            "ssh_public_key": "ssh-ed25519 AAAAC3Nza test",
            "scale_set": SS,
            "list_interval_s": 0.0,
            **options,
        }
    )
    ctx = ProviderContext(
        manager_address="10.0.0.4:7878",
        token_file=str(tmp_path / "token"),
        state_dir=str(tmp_path),
        heartbeat_interval_s=2.0,
        orphan_timeout_s=300.0,
    )
    return AzureProvider(opts, ctx, client=client, token="s3cret-token-0123456789"), transport


def test_first_create_makes_a_spot_scale_set_with_the_agent(tmp_path):
    provider, transport = _provider(
        tmp_path,
        {
            ("GET", BASE): (404, NOT_FOUND),
            ("PUT", BASE): (201, {**SCALE_SET, "properties": {"provisioningState": "Creating"}}),
        },
    )
    new = provider.create_vms("job1", ["job1-vm1", "job1-vm2"], 1, created_so_far=0)
    assert [vm.ref["placeholder"] for vm in new] == [True, True]
    put = transport.requests[-1]
    assert put["method"] == "PUT" and put["auth"] == "Bearer recorded-arm-token"
    body = put["json"]
    assert body["sku"] == {"name": "Standard_NC6s_v3", "tier": "Standard", "capacity": 2}
    profile = body["properties"]["virtualMachineProfile"]
    assert profile["priority"] == "Spot" and profile["evictionPolicy"] == "Delete"
    assert profile["billingProfile"] == {"maxPrice": -1}
    assert (
        body["properties"]["orchestrationMode"] == "Uniform" and body["properties"]["overprovision"] is False
    )
    nic = profile["networkProfile"]["networkInterfaceConfigurations"][0]
    assert nic["properties"]["ipConfigurations"][0]["properties"]["subnet"]["id"].endswith("subnets/default")
    script = base64.b64decode(profile["osProfile"]["customData"]).decode()
    assert "-m manager.agent.vm_agent --manager 10.0.0.4:7878" in script and "--job-id job1" in script
    assert "s3cret-token-0123456789" in script and "umask 077" in script
    # The agent polls the notice source the azure provider's registry entry names (its default
    # endpoint: Azure's Scheduled Events).
    assert "--notice-source manager.agent.scheduled_events:ScheduledEventsClient" in script
    assert "--approve-notices" in script and '--vm-id "$VM_NAME"' in script
    # Cut off from the manager, the agent fences its workers (Note [Fencing under the manager]).
    assert "--fence-timeout 17" in script and "--silence-probe-after" not in script  # the context's S: 0


def test_later_creates_raise_capacity(tmp_path):
    provider, transport = _provider(
        tmp_path,
        {
            ("GET", BASE): (200, SCALE_SET),
            ("PATCH", BASE): (200, {**SCALE_SET, "sku": {**SCALE_SET["sku"], "capacity": 5}}),
        },
    )
    provider.create_vms("job1", ["a", "b", "c"], 1, created_so_far=2)
    patch = transport.requests[-1]
    assert patch["method"] == "PATCH" and patch["json"]["sku"]["capacity"] == 5


def test_quota_error_is_one_line(tmp_path):
    provider, _ = _provider(tmp_path, {("GET", BASE): (200, SCALE_SET), ("PATCH", BASE): (409, QUOTA)})
    with pytest.raises(RuntimeError) as info:
        provider.create_vms("job1", ["a"], 1, created_so_far=2)
    assert "exceeding approved LowPriorityCores" in str(info.value) and "\n" not in str(info.value)


def test_delete_and_list_instances(tmp_path):
    provider, transport = _provider(
        tmp_path,
        {
            ("POST", BASE + "/delete"): (200, None),
            ("GET", BASE + "/virtualMachines"): (200, INSTANCES),
        },
    )
    vm = VMRecord(vm_id=f"{SS}_7", job_id="job1", provider="azure", seq=1, state="up", slots=1, created=0.0)
    provider.delete_vm(vm)
    assert transport.requests[-1]["json"] == {"instanceIds": ["7"]}
    assert provider.list_instances("job1") == {f"{SS}_0": "Succeeded", f"{SS}_3": "Deleting"}
    known = [
        VMRecord(vm_id=name, job_id="job1", provider="azure", seq=i, state="up", slots=1, created=0.0)
        for i, name in enumerate([f"{SS}_0", f"{SS}_3", f"{SS}_5"])
    ]
    assert sorted(provider.gone_vms(known)) == [f"{SS}_3", f"{SS}_5"]  # being deleted / evicted


def test_options_are_validated():
    with pytest.raises(ValueError, match="azure needs"):
        AzureProviderOptions.from_dict({"resource_group": RG})
    with pytest.raises(ValueError, match="unknown azure option"):
        AzureProviderOptions.from_dict({"vmsize": "x"})


def test_each_vm_type_gets_its_own_scale_set_and_size(tmp_path):
    """Mixed VM types (manager/domain/vm_types.py): VMs of a type go to ``<scale set>-<type>`` with the
    type's ``vm_size``; an eviction is noticed in every type's scale set."""
    typed = f"{BASE}-a100"
    provider, transport = _provider(
        tmp_path,
        {
            ("GET", typed): (404, NOT_FOUND),
            ("PUT", typed): (201, {**SCALE_SET, "name": f"{SS}-a100"}),
            ("GET", typed + "/virtualMachines"): (200, {"value": [
                {"id": f"{typed}/virtualMachines/1", "name": f"{SS}-a100_1", "instanceId": "1",
                 "properties": {"provisioningState": "Succeeded"}},
            ]}),
            ("GET", BASE + "/virtualMachines"): (200, INSTANCES),
        },
    )
    options = {"vm_type": "a100", "vm_size": "Standard_NC24ads_A100_v4", "vm_slowdown": 1.5}
    new = provider.create_vms("job1", ["job1-vm1"], 1, created_so_far=0, type_options=options)
    assert new[0].ref == {"placeholder": True, "scale_set": f"{SS}-a100"}
    put = transport.requests[-1]
    assert put["method"] == "PUT" and put["path"] == typed
    assert put["json"]["sku"] == {"name": "Standard_NC24ads_A100_v4", "tier": "Standard", "capacity": 1}
    known = [
        VMRecord(vm_id=f"{SS}-a100_{i}", job_id="job1", provider="azure", seq=i, state="up", slots=1,
                 created=0.0, provider_ref=json.dumps({"scale_set": f"{SS}-a100", "vm_type": "a100"}))
        for i in (1, 2)
    ] + [
        VMRecord(vm_id=f"{SS}_0", job_id="job1", provider="azure", seq=3, state="up", slots=1, created=0.0),
    ]
    assert provider.gone_vms(known) == [f"{SS}-a100_2"]  # listed per scale set; _2 was evicted
