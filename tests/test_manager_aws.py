"""The aws provider against moto's EC2, SSM and IAM over real HTTP (tests/fake_ec2.py: moto's
server behind a proxy that plays spot capacity and records who called what). The provider makes
its real boto3 calls, found through ``AWS_ENDPOINT_URL`` as the standard credential chain finds
its keys. No AWS account is involved; see docs/manager.md (AWS).

What is checked: the options (one line per bad one, per-type options); the ``RunInstances``
request (spot one-time, terminate on interruption, IMDSv2 only, tags, the instance profile, the
root volume); VM names by launch index; the token in an SSM SecureString and never in the user
data (unless asked); the user data run for real as two local "instances" (token fetched with the
instance role, mode 600, the agent started under the manager's name for each); capacity (partial,
none: no exception, exactly one attempt); every other error one line naming the fix; instances
gone (terminated, stopped, unlisted); delete (idempotent; the token parameter goes with the last
instance); a restarted manager: its recorded instances kept, unrecorded ones of its own
terminated after two listings, others' untouched; every call covered by the IAM policies that
docs/manager.md shows.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
pytest.importorskip("flask_cors")

from fake_ec2 import INSTANCE_KEY, MANAGER_KEY, FakeAWS, InstanceRunner, base_env  # noqa: E402
from fake_metadata import FakeIMDS  # noqa: E402

from manager.domain.jobspec import JobSpec  # noqa: E402
from manager.providers.aws import (  # noqa: E402
    AWS_IMDS_SOURCE,
    INSTANCE_IAM_POLICY,
    MANAGER_IAM_POLICY,
    AWSProvider,
    AWSProviderOptions,
    agent_user_data,
)
from manager.providers.base import ProviderContext  # noqa: E402
from manager.providers.registry import make_provider  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = dict(region="us-east-1", instance_type="g5.xlarge", image_id="ami-1", subnet_id="subnet-1",
                instance_profile="varuna-agent")


@dataclass
class VM:
    """What a provider sees of a VM (``manager.providers.base.ProviderVM``)."""

    vm_id: str
    job_id: str
    ref: dict[str, Any]
    state: str = "up"


@pytest.fixture(scope="module")
def aws_server():
    server = FakeAWS()
    yield server
    server.close()


@pytest.fixture
def fake(aws_server: FakeAWS, monkeypatch) -> FakeAWS:
    aws_server.reset()
    aws_server.calls.clear()
    aws_server.capacity = None
    for key, value in aws_server.env(MANAGER_KEY).items():  # the manager's credentials and endpoint
        monkeypatch.setenv(key, value)
    aws_server.net = aws_server.network()
    return aws_server


@pytest.fixture
def ctx(tmp_path: Path) -> ProviderContext:
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)
    return ProviderContext(manager_address="127.0.0.1:9", token_file=str(token),
                           state_dir=str(tmp_path / "state"), heartbeat_interval_s=0.5, orphan_timeout_s=120)


def make(fake: FakeAWS, ctx: ProviderContext, **over: Any) -> AWSProvider:
    options = {**fake.net, "instance_type": "g5.xlarge", "list_interval_s": 0, **over}
    provider = make_provider("aws", options, ctx)  # as the manager makes it: through the registry
    assert isinstance(provider, AWSProvider)
    return provider


def vms_of(new, job: str = "job1") -> list[VM]:
    return [VM(vm_id=v.vm_id, job_id=job, ref=dict(v.ref)) for v in new]


def launches(fake: FakeAWS) -> list[dict[str, str]]:
    return [c.params for c in fake.calls if c.action == "ec2:RunInstances"]


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


# -- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("patch, needle", [
    ({"region": ""}, "provider_options: aws needs region"),
    ({"colour": "red"}, "unknown aws option(s) colour; known: "),
    ({"instance_profile": ""}, "token_delivery ssm needs instance_profile"),
    ({"token_delivery": "email"}, "token_delivery must be ssm or user_data, got 'email'"),
    ({"max_price": "cheap"}, "max_price must be a price in USD per hour > 0, got 'cheap'"),
    ({"max_price": 0}, "max_price must be a price in USD per hour > 0, got 0"),
    ({"security_group_ids": "sg-1"}, "security_group_ids must be a list of ids, got 'sg-1'"),
    ({"tags": {"varuna-job": "x"}}, "none starting with aws: or varuna-"),
    ({"root_volume_gb": -5}, "root_volume_gb must be an integer >= 0, got -5"),
    ({"token_parameter_prefix": "varuna"}, "token_parameter_prefix must be a path like /varuna"),
])  # fmt: skip
def test_bad_options_are_one_line(patch, needle):
    with pytest.raises(ValueError) as bad:
        AWSProviderOptions.from_dict({**REQUIRED, **patch})
    assert needle in one_line(bad.value)
    o = AWSProviderOptions.from_dict({**REQUIRED, "max_price": 0.45, "token_delivery": "user_data"})
    assert (o.max_price, o.spot_options()["MaxPrice"]) == ("0.45", "0.45")


def test_vm_types_set_their_own_instance_type_and_subnet():
    base = dict(script="/t.py", global_batch_size=8, checkpoint_dir="/c", max_vms=2, target_steps=4,
                provider="aws", provider_options=REQUIRED)
    types = [{"name": "a100", "max_vms": 1, "provider_options": {"instance_type": "p4d.24xlarge",
                                                                  "subnet_id": "subnet-2", "max_price": 9}},
             {"name": "a10g", "max_vms": 1}]
    assert [t.name for t in JobSpec(**base, vm_types=types).vm_type_specs] == ["a100", "a10g"]
    for options, needle in [({"key_name": "k"}, "provider_options key_name is not a per-type aws option"),
                            ({"security_group_ids": "sg-1"}, "security_group_ids must be a list of ids")]:
        with pytest.raises(ValueError) as bad:
            JobSpec(**base, vm_types=[{"name": "t", "max_vms": 2, "provider_options": options}])
        assert one_line(bad.value).startswith("jobspec: vm_types t: ") and needle in str(bad.value)


# -- the user data ------------------------------------------------------------------------------


def test_user_data_is_valid_bash_and_keeps_the_token_out_unless_asked(ctx, tmp_path):
    token = Path(ctx.token_file).read_text()
    ssm = AWSProviderOptions.from_dict(REQUIRED)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB'x\n-----END CERTIFICATE-----\n")
    tls = dataclasses.replace(ctx, tls_ca=str(ca))
    in_user_data = AWSProviderOptions.from_dict({**REQUIRED, "token_delivery": "user_data"})
    for options, context in [(ssm, ctx), (ssm, tls), (in_user_data, ctx)]:
        script = agent_user_data(options, context, "job1", ["job1-vm1", "job1-vm2"], 2,
                                 token=token if options.token_delivery == "user_data" else None)
        check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, timeout=30)
        assert check.returncode == 0, check.stderr
        assert (token in script) == (options.token_delivery == "user_data")
        assert "NAMES=(job1-vm1 job1-vm2)" in script
        assert ("/varuna/job1/token" in script) == (options.token_delivery == "ssm")
        assert f"--notice-source {AWS_IMDS_SOURCE} --notice-url \"$IMDS\"" in script
        assert ('--tls-ca "$ETC/ca.pem"' in script) == (context.tls_ca is not None)
        assert f"--fence-timeout {context.fence_timeout_s:g}" in script  # cut off: the agent fences


@pytest.mark.slow  # processes: the user data's bash, python and agents
def test_the_user_data_fetches_the_token_and_starts_each_agent_under_its_name(fake, ctx, tmp_path):
    """Two instances run their user data for real (tests/fake_ec2.py's runner: a local process
    group each, its own IMDS): the token comes from SSM with the instance role's key into a file
    only its owner reads, and each agent gets the VM name of its launch index; a terminated
    instance's group is killed."""
    provider = make(fake, ctx, setup_command="true", python=sys.executable)
    imds = FakeIMDS(lookup=fake.launch_index)
    runner = InstanceRunner(fake, imds, tmp_path / "instances", base_env(fake, ROOT))
    try:
        new = provider.create_vms("job1", ["job1-vm1", "job1-vm2"], 2, created_so_far=0)
        assert [v.vm_id for v in new] == ["job1-vm1", "job1-vm2"]
        agents = {}
        for vm in new:
            iid = vm.ref["instance_id"]
            agents[vm.vm_id] = wait_for(lambda i=iid: agent_pid(i), 60, f"the agent of {iid}")
            etc = tmp_path / "instances" / iid / "etc"
            assert (etc / "token").read_text() == Path(ctx.token_file).read_text()
            assert (etc / "token").stat().st_mode & 0o777 == 0o600 and etc.stat().st_mode & 0o777 == 0o700
            argv = Path(f"/proc/{agents[vm.vm_id]}/cmdline").read_bytes().decode().split("\0")
            assert argv[argv.index("--vm-id") + 1] == vm.vm_id == argv[argv.index("--vm-name") + 1]
            assert argv[argv.index("--notice-url") + 1] == imds.base(iid)
            assert argv[argv.index("--token-file") + 1] == str(etc / "token")
        assert fake.actions(INSTANCE_KEY) == {"ssm:GetParameter"}
        assert covered(fake.actions(INSTANCE_KEY), INSTANCE_IAM_POLICY)
        fake.client("ec2").terminate_instances(InstanceIds=[new[0].ref["instance_id"]])
        wait_for(lambda: not alive(agents["job1-vm1"]), 30, "the terminated instance's agent to be killed")
        assert alive(agents["job1-vm2"])
    finally:
        runner.close()
        imds.close()
    assert not any(alive(pid) for pid in agents.values())


def agent_pid(instance_id: str) -> int:
    """The pid of the agent process the instance's user data started, 0 while there is none."""
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"VARUNA_TEST_INSTANCE={instance_id}".encode() in environ and b"manager.agent.vm_agent" in cmdline:
            return int(entry.name)
    return 0


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


# -- creating VMs -------------------------------------------------------------------------------


def test_create_asks_for_spot_instances_and_names_them_by_launch_index(fake, ctx):
    provider = make(fake, ctx, root_volume_gb=200, key_name="ops", tags={"team": "ml"})
    new = provider.create_vms("job1", ["job1-vm1", "job1-vm2", "job1-vm3"], 2, created_so_far=0)
    [req] = launches(fake)
    assert (req["MinCount"], req["MaxCount"], req["InstanceType"]) == ("1", "3", "g5.xlarge")
    assert req["InstanceMarketOptions.MarketType"] == "spot"
    assert req["InstanceMarketOptions.SpotOptions.SpotInstanceType"] == "one-time"
    assert req["InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior"] == "terminate"
    assert "InstanceMarketOptions.SpotOptions.MaxPrice" not in req  # up to the on-demand price
    metadata = (req["MetadataOptions.HttpTokens"], req["MetadataOptions.HttpPutResponseHopLimit"])
    assert metadata == ("required", "1")
    assert req["IamInstanceProfile.Name"] == "varuna-agent" and req["KeyName"] == "ops"
    assert req["InstanceInitiatedShutdownBehavior"] == "terminate"
    assert req["BlockDeviceMapping.1.Ebs.VolumeSize"] == "200"
    assert req["BlockDeviceMapping.1.DeviceName"] == fake.client("ec2").describe_images(
        ImageIds=[req["ImageId"]])["Images"][0]["RootDeviceName"]
    user_data = base64.b64decode(req["UserData"]).decode()
    assert Path(ctx.token_file).read_text() not in user_data and "/varuna/job1/token" in user_data
    instances = fake.instances()
    assert [v.vm_id for v in new] == ["job1-vm1", "job1-vm2", "job1-vm3"]
    for vm in new:
        inst = instances[vm.ref["instance_id"]]
        tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
        assert inst["InstanceLifecycle"] == "spot" and inst["InstanceType"] == "g5.xlarge"
        assert vm.vm_id == f"job1-vm{inst['AmiLaunchIndex'] + 1}"
        assert tags == {"varuna-job": "job1", "varuna-manager": provider.manager_id, "team": "ml",
                        "varuna-vm-type": "g5.xlarge", "Name": vm.vm_id, "varuna-vm": vm.vm_id}
    param = fake.client("ssm").get_parameter(Name="/varuna/job1/token", WithDecryption=True)["Parameter"]
    assert (param["Type"], param["Value"]) == ("SecureString", Path(ctx.token_file).read_text())
    assert covered(fake.actions(MANAGER_KEY), MANAGER_IAM_POLICY)


def test_a_vm_type_launches_its_own_instance_type_in_its_own_subnet(fake, ctx):
    provider = make(fake, ctx)
    ec2 = fake.client("ec2")
    vpc = ec2.describe_subnets(SubnetIds=[provider.options.subnet_id])["Subnets"][0]["VpcId"]
    other = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.2.0/24",
                              AvailabilityZone="us-east-1b")["Subnet"]["SubnetId"]
    type_options = {"vm_type": "big", "vm_slowdown": 1.0, "instance_type": "p4d.24xlarge", "subnet_id": other,
                    "max_price": "12.5"}
    [vm] = provider.create_vms("job1", ["job1-vm1"], 8, created_so_far=0, type_options=type_options)
    [req] = launches(fake)
    assert (req["InstanceType"], req["SubnetId"], req["InstanceMarketOptions.SpotOptions.MaxPrice"]) == (
        "p4d.24xlarge", other, "12.5")
    assert vm.ref["instance_type"] == "p4d.24xlarge"
    assert fake.instances()[vm.ref["instance_id"]]["SubnetId"] == other


def test_short_capacity_gives_fewer_or_no_vms_in_one_attempt(fake, ctx):
    provider = make(fake, ctx)
    fake.capacity = 3
    first = provider.create_vms("job1", ["job1-vm1", "job1-vm2"], 1, created_so_far=0)
    partial = provider.create_vms("job1", ["job1-vm3", "job1-vm4"], 1, created_so_far=2)
    assert [v.vm_id for v in first + partial] == ["job1-vm1", "job1-vm2", "job1-vm3"]
    assert provider.create_vms("job1", ["job1-vm4"], 1, created_so_far=3) == []  # no exception
    # One attempt each: botocore would retry EC2's HTTP 500 (Note [No SDK retries for RunInstances]).
    assert len(launches(fake)) == 3
    fake.capacity = 4  # capacity came back
    assert [v.vm_id for v in provider.create_vms("job1", ["job1-vm4"], 1, created_so_far=3)] == ["job1-vm4"]


@pytest.mark.parametrize("code, status, message, needle", [
    ("MaxSpotInstanceCountExceeded", 400, "Max spot instance count exceeded",
     "spot instance quota is reached"),
    ("VcpuLimitExceeded", 400, "You have requested more vCPU capacity than your current vCPU limit",
     "vCPU quota for this instance family"),
    ("SpotMaxPriceTooLow", 400, "Your Spot request price of 0.01 is lower than the minimum required Spot "
     "request fulfillment price of 0.3.", "raise it, or leave it unset"),
    ("Unsupported", 400, "Your requested instance type (g5.xlarge) is not supported in your requested "
     "Availability Zone (us-east-1e).", "use a subnet in another zone"),
    ("UnauthorizedOperation", 403, "You are not authorized to perform this operation.",
     "attach the IAM policy of docs/manager.md (AWS)"),
    ("RequestLimitExceeded", 503, "Request limit exceeded.", "throttled"),
])  # fmt: skip
def test_other_launch_errors_are_one_line_naming_the_fix(fake, ctx, code, status, message, needle):
    provider = make(fake, ctx)
    fake.fail_next("ec2:RunInstances", code, message, status)
    with pytest.raises(RuntimeError) as failed:
        provider.create_vms("job1", ["job1-vm1"], 1, created_so_far=0)
    line = one_line(failed.value)
    assert line.startswith("aws: cannot start 1 g5.xlarge spot instance(s) in subnet-") and needle in line
    assert f"{code}: {message}" in line
    assert len(launches(fake)) == 1 and fake.instances() == {}


def test_moto_refuses_a_bad_subnet_and_no_credentials_is_one_line(fake, ctx, monkeypatch):
    provider = make(fake, ctx, subnet_id="subnet-0000000000nope")
    with pytest.raises(RuntimeError, match=r"InvalidSubnetID\.NotFound") as bad:
        provider.create_vms("job1", ["job1-vm1"], 1, created_so_far=0)
    one_line(bad.value)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    stranger = make(fake, ctx)
    with pytest.raises(RuntimeError) as none:
        stranger.create_vms("job1", ["job1-vm1"], 1, created_so_far=0)
    assert one_line(none.value) == (
        "aws: cannot store the agents' token in SSM parameter /varuna/job1/token: NoCredentialsError: "
        "Unable to locate credentials; configure credentials for boto3 (environment, ~/.aws, or the "
        "host's role)")


def test_user_data_over_ec2s_limit_is_one_line(fake, ctx):
    provider = make(fake, ctx, setup_command="true " + "x" * 17000)
    with pytest.raises(RuntimeError, match=r"over EC2's 16384: shorten setup_command") as big:
        provider.create_vms("job1", ["job1-vm1"], 1, created_so_far=0)
    one_line(big.value)
    assert launches(fake) == []


# -- watching and deleting ----------------------------------------------------------------------


def test_gone_vms_are_terminated_stopped_or_unlisted_ones(fake, ctx):
    provider = make(fake, ctx)
    vms = vms_of(provider.create_vms("job1", ["job1-vm1", "job1-vm2", "job1-vm3"], 1, created_so_far=0))
    ec2 = fake.client("ec2")
    ec2.terminate_instances(InstanceIds=[vms[0].ref["instance_id"]])  # a spot interruption
    ec2.stop_instances(InstanceIds=[vms[1].ref["instance_id"]])
    lost = VM("job1-vm9", "job1", {"instance_id": "i-0123456789abcdef0"})  # gone for more than an hour
    young = VM("job1-vm8", "job1", {"instance_id": "i-0fedcba9876543210"})
    provider._launched["i-0fedcba9876543210"] = time.monotonic()  # just launched: not listed yet is fine
    assert provider.gone_vms([*vms, lost, young]) == ["job1-vm1", "job1-vm2", "job1-vm9"]
    slow = make(fake, ctx, list_interval_s=3600)
    listed = [c for c in fake.calls if c.action == "ec2:DescribeInstances"]
    assert slow.gone_vms(vms) and slow.gone_vms(vms) == []  # at most one listing per interval
    assert len([c for c in fake.calls if c.action == "ec2:DescribeInstances"]) == len(listed) + 1


def test_delete_terminates_and_the_token_goes_with_the_last_instance(fake, ctx):
    provider = make(fake, ctx)
    vms = vms_of(provider.create_vms("job1", ["job1-vm1", "job1-vm2"], 1, created_so_far=0))
    ssm = fake.client("ssm")
    provider.delete_vm(vms[0])
    assert fake.instances()[vms[0].ref["instance_id"]]["State"]["Name"] == "terminated"
    assert ssm.get_parameter(Name="/varuna/job1/token")  # the other instance may still boot
    provider.delete_vm(vms[1])
    provider.delete_vm(vms[1])  # idempotent
    provider.delete_vm(VM("job1-vm7", "job1", {"instance_id": "i-0123456789abcdef0"}))  # unknown to EC2: fine
    assert {i["State"]["Name"] for i in fake.instances().values()} == {"terminated"}
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name="/varuna/job1/token")
    # A job that gets VMs again gets its parameter again.
    provider.create_vms("job1", ["job1-vm3"], 1, created_so_far=2)
    assert ssm.get_parameter(Name="/varuna/job1/token")
    assert covered(fake.actions(MANAGER_KEY), MANAGER_IAM_POLICY)


def test_a_restarted_manager_keeps_its_instances_and_ends_the_ones_it_never_recorded(fake, ctx):
    before = make(fake, ctx)
    new = before.create_vms("job1", ["job1-vm1", "job1-vm2", "job1-vm3"], 1, created_so_far=0)
    recorded = vms_of(new[:2])  # the manager died before it stored job1-vm3
    other_job = before.create_vms("job2", ["job2-vm1"], 1, created_so_far=0)
    other_manager = make(fake, ctx, manager_id="someone-else").create_vms("job1", ["job1-vm1"], 1,
                                                                          created_so_far=0)
    after = make(fake, ctx)  # the restarted manager: same host and state directory
    assert after.manager_id == before.manager_id
    assert after.gone_vms(recorded) == []
    state = lambda vm: fake.instances()[vm.ref["instance_id"]]["State"]["Name"]  # noqa: E731
    assert state(new[2]) == "running", "one listing is not proof"
    assert after.gone_vms(recorded) == []
    assert state(new[2]) == "terminated"
    assert [state(v) for v in (*new[:2], *other_job, *other_manager)] == ["running"] * 4


# -- the IAM policies that docs/manager.md shows -----------------------------------------------


def covered(actions: set[str], policy: dict) -> bool:
    allowed = set()
    for statement in policy["Statement"]:
        names = statement["Action"]
        allowed.update([names] if isinstance(names, str) else names)
    missing = actions - allowed
    assert not missing, f"calls the IAM policy does not allow: {sorted(missing)}"
    return True


def test_the_docs_show_the_policies_the_code_is_checked_against():
    text = (ROOT / "docs" / "manager.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", text[text.index("### AWS"):], re.S)
    assert [json.loads(b) for b in blocks[:2]] == [MANAGER_IAM_POLICY, INSTANCE_IAM_POLICY]
