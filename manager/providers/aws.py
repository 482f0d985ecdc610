"""AWS EC2 spot instances (boto3), one ``RunInstances`` call per request for VMs.

- ``create_vms(names)``: ``RunInstances`` with ``MinCount=1, MaxCount=len(names)`` and
  ``InstanceMarketOptions`` spot (one-time, interruption behaviour ``terminate``: an interrupted
  VM disappears instead of lingering stopped with its disk billed; ``max_price`` unset: pay up to
  the on-demand price, so interruptions only come from capacity). The instances are tagged with
  the job (``varuna-job``) and this manager (``varuna-manager``) at launch, and named after the
  manager's VM names (``Name``, ``varuna-vm``) right after.
- ``delete_vm``: ``TerminateInstances`` of its instance; the job's token parameter goes with the
  job's last instance.
- ``gone_vms``: ``DescribeInstances`` of the job's tagged instances (at most every
  ``list_interval_s``): an instance ``shutting-down``, ``terminated``, ``stopping`` or
  ``stopped``, or no longer listed, is gone; the agents also read the two-minute interruption
  notice from IMDS (:mod:`manager.agent.aws_imds`).

Note [Why RunInstances]: the manager asks for N VMs and takes any number up to N (fewer when spot
capacity is short, the rest later). ``RunInstances`` with ``MinCount=1, MaxCount=N`` is exactly
that in one call: EC2 launches as many as it can up to N, or none with
``InsufficientInstanceCapacity``. An EC2 Fleet of type ``instant`` also returns partial
fulfilment, but it needs a launch template (one more resource per job and VM type to create and
clean up) and its strength, spreading a request over instance types and zones, is what a
training job does not want: a VM type is one instance type (the manager plans by type), and one
subnet keeps a job's VMs in one availability zone (inter-VM bandwidth, no cross-zone traffic
charges). Several subnets or instance types are several ``[[vm_types]]``.

Note [VM names on EC2]: the manager names its VMs (``job-vm3``); one ``RunInstances`` call has
one user data for all its instances, so the user data lists the names asked for and each
instance takes the one at its ``ami-launch-index`` (0 .. launched−1, read from IMDS), the same
mapping the manager makes from the ``AmiLaunchIndex`` of the instances EC2 returns. No tag has
to reach the instance before it boots.

Note [The token on EC2]: the agent needs the manager's bearer token. With ``token_delivery =
"ssm"`` (the default) the manager stores it as an SSM Parameter Store ``SecureString``
(``/varuna/<job>/token``, KMS-encrypted, tagged, deleted with the job's last instance) and the
user data fetches it with the instance profile's role, as root, into ``/etc/varuna/token`` (mode
600). User data is not a place for a secret: anyone in the account allowed
``ec2:DescribeInstanceAttribute`` (part of AWS's ReadOnlyAccess) reads it in clear, and it stays
with the instance. The parameter is readable only by principals granted ``ssm:GetParameter`` on
``/varuna/*`` (the instances' role) and each read is in CloudTrail. ``token_delivery =
"user_data"`` puts the token in the user data anyway (no instance profile needed; say so
knowingly). On the instance itself both are equally exposed to code running as root, which the
agent and its workers are.

Note [No SDK retries for RunInstances]: EC2 answers ``InsufficientInstanceCapacity`` with HTTP
500, which botocore retries (up to 4 times, with back-off) as if it were transient; capacity does
not come back in seconds, and ``RunInstances`` has a low request rate limit. The launch client
makes one attempt; the manager asks again every ``--create-retry`` seconds. Other calls retry in
botocore's ``standard`` mode.

Errors: ``InsufficientInstanceCapacity`` is spot capacity running short: ``create_vms`` returns
no VM (the manager's ``capacity`` event, and it asks again). Everything else is a ``RuntimeError``
with one line naming the fix (``provider-error`` events): quotas (``MaxSpotInstanceCountExceeded``,
``VcpuLimitExceeded``, ``InstanceLimitExceeded``), ``SpotMaxPriceTooLow``, an instance type the
zone does not offer (``Unsupported``), missing permissions, bad ids, no credentials.

Credentials: boto3's standard chain (environment, ``~/.aws``, SSO, the manager host's own role);
``AWS_ENDPOINT_URL`` is honoured, which is how tests point it at moto. Nothing here has reached
real AWS from this repository (docs/manager.md, AWS).

    >>> opts = AWSProviderOptions.from_dict(dict(region="us-east-1", instance_type="g5.xlarge",
    ...     image_id="ami-1", subnet_id="subnet-1", instance_profile="varuna-agent"))
    >>> opts.token_delivery, opts.spot_options()
    ('ssm', {'SpotInstanceType': 'one-time', 'InstanceInterruptionBehavior': 'terminate'})
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from manager.providers.agent_start import AgentStart, agent_argv, shell_command
from manager.providers.base import NewVM, ProviderContext, ProviderVM
from manager.providers.registry import ProviderExtra, register_provider

__all__ = [
    "AWS_EXTRA",
    "AWS_IMDS_SOURCE",
    "INSTANCE_IAM_POLICY",
    "MANAGER_IAM_POLICY",
    "AWSProvider",
    "AWSProviderOptions",
    "agent_user_data",
]

#: The agents' notice source: IMDS ``spot/instance-action`` (manager/agent/aws_imds.py).
AWS_IMDS_SOURCE = "manager.agent.aws_imds:InstanceActionClient"
#: What a ``[[vm_types]]`` table may set per type.
TYPE_OPTION_KEYS = (
    "instance_type", "image_id", "subnet_id", "security_group_ids", "max_price", "root_volume_gb",
)
#: Tags on every instance (and its volumes): the job, this manager, the manager's VM name.
JOB_TAG, MANAGER_TAG, VM_TAG = "varuna-job", "varuna-manager", "varuna-vm"
#: Instance states in which a VM no longer runs its agent.
GONE_STATES = ("shutting-down", "terminated", "stopping", "stopped")
#: An instance this process launched is trusted to exist this long even when ``DescribeInstances``
#: does not list it yet (EC2's API is eventually consistent).
LISTING_GRACE_S = 120.0
#: EC2's limit on user data (before base64).
USER_DATA_LIMIT = 16384
#: Spot capacity running short: no VM now, asked again later (module docstring).
CAPACITY_CODES = ("InsufficientInstanceCapacity",)
#: Errors whose one line names a fix of the user's.
_FIXES = {
    "MaxSpotInstanceCountExceeded": "the account's spot instance quota is reached: raise it (Service Quotas, "
    "EC2 spot instance requests) or lower max_vms",
    "VcpuLimitExceeded": "the account's vCPU quota for this instance family is reached: raise it (Service "
    "Quotas) or lower max_vms",
    "InstanceLimitExceeded": "the account's instance quota is reached: raise it or lower max_vms",
    "SpotMaxPriceTooLow": "the spot price is above provider_options.max_price: raise it, or leave it unset "
    "(pay up to the on-demand price)",
    "Unsupported": "the instance type is not offered in this subnet's availability zone: use a subnet in "
    "another zone",
    "UnauthorizedOperation": "the manager's AWS credentials lack a permission: attach the IAM policy of "
    "docs/manager.md (AWS)",
    "AccessDeniedException": "the manager's AWS credentials lack a permission: attach the IAM policy of "
    "docs/manager.md (AWS)",
    "RequestLimitExceeded": "EC2 throttled the request; the manager asks again later",
}

#: What the manager's credentials must allow (docs/manager.md shows this policy).
MANAGER_IAM_POLICY: dict[str, Any] = {
    "Version": "2012-10-17",
    "Statement": [
        {"Sid": "LaunchSpotInstances", "Effect": "Allow", "Action": "ec2:RunInstances", "Resource": "*"},
        {"Sid": "TagThemAtLaunch", "Effect": "Allow", "Action": "ec2:CreateTags", "Resource": "*",
         "Condition": {"StringEquals": {"ec2:CreateAction": "RunInstances"}}},
        {"Sid": "NameItsInstances", "Effect": "Allow", "Action": "ec2:CreateTags", "Resource": "*",
         "Condition": {"StringLike": {f"ec2:ResourceTag/{JOB_TAG}": "*"}}},
        {"Sid": "ListInstancesAndImages", "Effect": "Allow",
         "Action": ["ec2:DescribeInstances", "ec2:DescribeImages"], "Resource": "*"},
        {"Sid": "TerminateOnlyItsInstances", "Effect": "Allow", "Action": "ec2:TerminateInstances",
         "Resource": "*", "Condition": {"StringLike": {f"ec2:ResourceTag/{JOB_TAG}": "*"}}},
        {"Sid": "GiveInstancesTheirRole", "Effect": "Allow", "Action": "iam:PassRole", "Resource": "*",
         "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}},
        {"Sid": "TheAgentsToken", "Effect": "Allow",
         "Action": ["ssm:PutParameter", "ssm:DeleteParameter", "ssm:AddTagsToResource"],
         "Resource": "arn:aws:ssm:*:*:parameter/varuna/*"},
    ],
}  # fmt: skip
#: What the instances' role (``instance_profile``) must allow: reading the token (token_delivery
#: "ssm"; with ``token_kms_key_id`` also ``kms:Decrypt`` on that key).
INSTANCE_IAM_POLICY: dict[str, Any] = {
    "Version": "2012-10-17",
    "Statement": [
        {"Sid": "ReadTheManagersToken", "Effect": "Allow", "Action": "ssm:GetParameter",
         "Resource": "arn:aws:ssm:*:*:parameter/varuna/*"},
    ],
}  # fmt: skip


def _string_list(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
        isinstance(v, str) and v for v in value
    ):
        raise ValueError(f"provider_options.{name} must be a list of ids, got {value!r}")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class AWSProviderOptions:
    """``provider_options`` of an aws job (docs/manager.md, AWS)."""

    region: str
    instance_type: str
    """e.g. ``g5.xlarge`` (a ``[[vm_types]]`` table sets its own)."""
    image_id: str
    """The AMI (with Python 3.10+ and curl; the setup command installs varuna)."""
    subnet_id: str
    """Where the instances go (one availability zone); the manager's address must be reachable from it."""
    security_group_ids: tuple[str, ...] = ()
    key_name: str = ""
    """An EC2 key pair for SSH (none: no SSH key)."""
    instance_profile: str = ""
    """Name or ARN of the instances' instance profile; its role reads the token (``ssm``)."""
    token_delivery: str = "ssm"
    """``ssm`` (SecureString parameter, Note [The token on EC2]) or ``user_data``."""
    token_parameter_prefix: str = "/varuna"
    """The parameter is ``<prefix>/<job id>/token``."""
    token_kms_key_id: str = ""
    """KMS key of the parameter (empty: the account's ``aws/ssm`` key)."""
    max_price: str = ""
    """Highest price per instance-hour in USD (empty: the on-demand price)."""
    root_volume_gb: int = 0
    """Size of the root volume (0: the AMI's)."""
    setup_command: str = "python3 -m pip install --quiet 'varuna[manager,aws]'"
    """Shell command the user data runs before starting the agent (installs this package: the agent
    speaks gRPC; boto3 reads the token parameter)."""
    python: str = "python3"
    list_interval_s: float = 15.0
    manager_id: str = ""
    """Tag value naming this manager (empty: derived from its host name and state directory)."""
    tags: dict[str, str] = field(default_factory=dict)
    """More tags for the instances and their volumes (cost allocation...)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AWSProviderOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"provider_options: unknown aws option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        required = ("region", "instance_type", "image_id", "subnet_id")
        missing = [k for k in required if not data.get(k)]
        if missing:
            raise ValueError(f"provider_options: aws needs {', '.join(missing)}")
        values = dict(data)
        values["security_group_ids"] = _string_list("security_group_ids", data.get("security_group_ids", []))
        if "max_price" in values:
            values["max_price"] = _price(values["max_price"])
        opts = cls(**values)
        opts._check()
        return opts

    def _check(self) -> None:
        for name in ("region", "instance_type", "image_id", "subnet_id", "key_name", "instance_profile",
                     "python", "manager_id", "token_kms_key_id"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"provider_options.{name} must be a string, got {getattr(self, name)!r}")
        if self.token_delivery not in ("ssm", "user_data"):
            raise ValueError(
                f"provider_options.token_delivery must be ssm or user_data, got {self.token_delivery!r}"
            )
        if self.token_delivery == "ssm" and not self.instance_profile:
            raise ValueError(
                "provider_options: token_delivery ssm needs instance_profile (a role that may "
                "ssm:GetParameter the token; docs/manager.md, AWS), or set token_delivery = \"user_data\""
            )
        if not re.fullmatch(r"(/[A-Za-z0-9_.-]+)+", str(self.token_parameter_prefix)):
            raise ValueError(
                "provider_options.token_parameter_prefix must be a path like /varuna, "
                f"got {self.token_parameter_prefix!r}"
            )
        size = self.root_volume_gb
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"provider_options.root_volume_gb must be an integer >= 0, got {size!r}")
        if not isinstance(self.list_interval_s, (int, float)) or self.list_interval_s < 0:
            raise ValueError(f"provider_options.list_interval_s must be >= 0, got {self.list_interval_s!r}")
        if not isinstance(self.tags, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and not k.startswith(("aws:", "varuna-"))
            for k, v in self.tags.items()
        ):
            raise ValueError(
                "provider_options.tags must map names to strings, none starting with aws: or varuna-, "
                f"got {self.tags!r}"
            )

    def spot_options(self) -> dict[str, Any]:
        """``InstanceMarketOptions.SpotOptions`` (module docstring)."""
        spot: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
        if self.max_price:
            spot["MaxPrice"] = self.max_price
        return spot


def _price(value: Any) -> str:
    """``max_price`` as EC2 wants it (a decimal string); ``ValueError`` unless a positive number."""
    if value in ("", None):
        return ""
    try:
        price = float(value)
    except (TypeError, ValueError):
        price = -1.0
    if isinstance(value, bool) or not price > 0:
        raise ValueError(f"provider_options.max_price must be a price in USD per hour > 0, got {value!r}")
    return f"{price:g}"


def token_parameter(options: AWSProviderOptions, job_id: str) -> str:
    """The SSM parameter holding the token for ``job_id``'s instances."""
    return f"{options.token_parameter_prefix.rstrip('/')}/{job_id}/token"


#: The user data's paths, each overridable through the environment (how the tests run the script
#: as a local process: a temporary directory, a local IMDS).
_SCRIPT_VARS = {
    "IMDS": ("VARUNA_IMDS", "http://169.254.169.254"),
    "ETC": ("VARUNA_ETC", "/etc/varuna"),
    "LOGS": ("VARUNA_LOGS", "/var/log/varuna"),
}

# Reads the SSM parameter (argv: name, region) with the instance profile's credentials, which may
# take a few seconds to appear after boot; prints the value.
_FETCH_TOKEN = """\
import sys, time
import boto3
from botocore.exceptions import BotoCoreError, ClientError
name, region = sys.argv[1], sys.argv[2]
for attempt in range(30):
    try:
        ssm = boto3.client("ssm", region_name=region)
        sys.stdout.write(ssm.get_parameter(Name=name, WithDecryption=True)["Parameter"]["Value"])
        break
    except (BotoCoreError, ClientError) as exc:
        if attempt == 29:
            sys.exit(f"varuna: cannot read the token parameter {name}: {exc}")
        time.sleep(2)
"""


def agent_user_data(
    options: AWSProviderOptions,
    context: ProviderContext,
    job_id: str,
    names: Sequence[str],
    slots: int,
    *,
    token: str | None = None,
) -> str:
    """The user data (a shell script cloud-init runs as root) that starts the agent on each of
    the instances one ``RunInstances`` call launches for ``names`` (Note [VM names on EC2]);
    ``token``: the token itself (``token_delivery = "user_data"``), else it is read from SSM."""
    q = shlex.quote
    argv = agent_argv(AgentStart(
        python=options.python,
        manager=context.manager_address,
        token_file="$ETC/token",
        vm_id="$VM_NAME",  # this instance's name: from its launch index, below
        job_id=job_id,
        slots=slots,
        log_dir="$LOGS",
        heartbeat_interval_s=context.heartbeat_interval_s,
        orphan_timeout_s=context.orphan_timeout_s,
        fence_timeout_s=context.fence_timeout_s,  # Note [Fencing under the manager]
        silence_probe_after_s=context.silence_probe_after_s,
        tls_ca="$ETC/ca.pem" if context.tls_ca else None,
        notice_source=AWS_IMDS_SOURCE,
        notice_url="$IMDS",
        vm_name="$VM_NAME",
        standby=slots,
    ))
    cmd = shell_command(argv, expand={"$ETC/token", "$VM_NAME", "$LOGS", "$ETC/ca.pem", "$IMDS"})
    lines = [
        "#!/bin/bash",
        "# Starts varuna's agent on this instance (manager/providers/aws.py).",
        "set -euo pipefail",
        *(f'{var}="${{{env}:-{default}}}"' for var, (env, default) in _SCRIPT_VARS.items()),
        'install -d -m 700 "$ETC" "$LOGS"',
        "imds() {  # IMDSv2: a session token, then the item",
        "  local t",
        "  t=$(curl -sf --retry 5 --noproxy '*' -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 300' "
        '"$IMDS/latest/api/token")',
        "  curl -sf --retry 5 --noproxy '*' -H \"X-aws-ec2-metadata-token: $t\" "
        '"$IMDS/latest/meta-data/$1"',
        "}",
        f"NAMES=({' '.join(q(n) for n in names)})",
        "INDEX=$(imds ami-launch-index)",
        'VM_NAME="${NAMES[$INDEX]:-}"',
        '[ -n "$VM_NAME" ] || { echo "varuna: no VM name for launch index $INDEX" >&2; exit 1; }',
    ]
    if context.tls_ca:
        with open(context.tls_ca, encoding="utf-8") as f:
            lines.append(f"printf '%s' {q(f.read())} > \"$ETC/ca.pem\"")
    lines.append(options.setup_command)
    if token is not None:
        lines.append(f"(umask 077; printf '%s' {q(token)} > \"$ETC/token\")")
    else:
        name = token_parameter(options, job_id)
        lines += [
            f"(umask 077; {q(options.python)} - {q(name)} {q(options.region)} "
            "> \"$ETC/token.new\" <<'VARUNA_PY'",
            _FETCH_TOKEN.rstrip("\n"),
            "VARUNA_PY",
            ")",
            'mv "$ETC/token.new" "$ETC/token"',
        ]
    lines.append(f'nohup {cmd} >> "$LOGS/agent.log" 2>&1 &')
    return "\n".join(lines) + "\n"


#: What needs the aws extra, as its one-line error names it.
AWS_WHAT = "the aws provider (on the manager's host)"
#: The aws extra (pyproject.toml).
AWS_EXTRA = ProviderExtra(name="aws", packages={"boto3": "boto3"}, what=AWS_WHAT)


def _error_line(exc: Exception) -> tuple[str, str]:
    """(code, one line) of a boto3 error."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        err = response.get("Error") or {}
        code = str(err.get("Code") or "")
        message = str(err.get("Message") or exc)
    else:
        code, message = type(exc).__name__, str(exc)
    return code, " ".join(message.split())


@register_provider(
    name="aws",
    options=AWSProviderOptions,
    extra=AWS_EXTRA,
    type_options=TYPE_OPTION_KEYS,
    notice_source=AWS_IMDS_SOURCE,
)
class AWSProvider:
    """See the module docstring. ``session`` (a ``boto3.session.Session``) is for tests and special
    set-ups; by default one is made for ``options.region`` with the standard credential chain."""

    name = "aws"

    def __init__(self, options: AWSProviderOptions, context: ProviderContext, *, session: Any = None) -> None:
        if session is None:
            AWS_EXTRA.require()
        self.options = options
        self.context = context
        self._session = session
        self._clients: dict[str, Any] = {}
        self._token: str | None = None
        self._parameters: set[str] = set()  # token parameters written by this process
        self._launched: dict[str, float] = {}  # instance id -> when this process launched it
        self._last_list = float("-inf")
        self._suspects: set[str] = set()  # unknown instances of the last listing (orphans if seen twice)
        self.manager_id = options.manager_id or hashlib.sha256(
            f"{socket.gethostname()}:{os.path.abspath(context.state_dir)}".encode()
        ).hexdigest()[:12]

    # -- SDK plumbing --------------------------------------------------------------------------

    def client(self, service: str, *, retries: bool = True) -> Any:
        """A boto3 client of ``service`` (Note [No SDK retries for RunInstances])."""
        key = f"{service}:{retries}"
        if key not in self._clients:
            import boto3
            from botocore.config import Config

            session = self._session or boto3.session.Session(region_name=self.options.region)
            config = Config(
                region_name=self.options.region,
                retries={"mode": "standard", "total_max_attempts": 5 if retries else 1},
                connect_timeout=10,
                read_timeout=30,
            )
            self._clients[key] = session.client(service, config=config)
        return self._clients[key]

    def _read_token(self) -> str:
        if self._token is None:
            from manager.common.wire import load_token

            self._token = load_token(self.context.token_file)
        return self._token

    def _typed(self, type_options: Mapping[str, Any] | None) -> AWSProviderOptions:
        """The options of a VM type (its ``provider_options`` replace the job's)."""
        overrides = {k: v for k, v in (type_options or {}).items() if k in TYPE_OPTION_KEYS}
        if not overrides:
            return self.options
        return AWSProviderOptions.from_dict({**dataclasses.asdict(self.options), **overrides})

    def _tags(self, job_id: str, extra: Mapping[str, str] | None = None) -> list[dict[str, str]]:
        tags = {**self.options.tags, JOB_TAG: job_id, MANAGER_TAG: self.manager_id, **(extra or {})}
        return [{"Key": k, "Value": v} for k, v in tags.items()]

    def _fail(self, what: str, exc: Exception) -> RuntimeError:
        code, message = _error_line(exc)
        fix = _FIXES.get(code) or ("configure credentials for boto3 (environment, ~/.aws, or the host's role)"
                                   if code == "NoCredentialsError" else "")
        line = f"aws: {what}: {code + ': ' if code else ''}{message}"
        return RuntimeError((f"{line}; {fix}" if fix else line).splitlines()[0])

    # -- the token parameter (Note [The token on EC2]) -----------------------------------------

    def _ensure_token_parameter(self, job_id: str) -> None:
        name = token_parameter(self.options, job_id)
        if self.options.token_delivery != "ssm" or name in self._parameters:
            return
        from botocore.exceptions import BotoCoreError, ClientError

        ssm = self.client("ssm")
        put = {"Name": name, "Value": self._read_token(), "Type": "SecureString", "Tier": "Standard",
               "Description": f"varuna manager token for the instances of job {job_id}"}
        if self.options.token_kms_key_id:
            put["KeyId"] = self.options.token_kms_key_id
        try:
            try:
                ssm.put_parameter(**put, Tags=self._tags(job_id))
            except ClientError as exc:
                if _error_line(exc)[0] != "ParameterAlreadyExists":
                    raise
                ssm.put_parameter(**put, Overwrite=True)  # a restarted manager: same name (tags stay)
        except (BotoCoreError, ClientError) as exc:
            raise self._fail(f"cannot store the agents' token in SSM parameter {name}", exc) from exc
        self._parameters.add(name)

    def _drop_token_parameter(self, job_id: str) -> None:
        """Delete the job's parameter once none of its instances may still need it."""
        if self.options.token_delivery != "ssm":
            return
        from botocore.exceptions import BotoCoreError, ClientError

        alive = [i for i, (state, _) in self.list_instances(job_id).items() if state not in GONE_STATES]
        if alive:
            return
        name = token_parameter(self.options, job_id)
        try:
            self.client("ssm").delete_parameter(Name=name)
        except ClientError as exc:
            if _error_line(exc)[0] != "ParameterNotFound":
                raise self._fail(f"cannot delete SSM parameter {name}", exc) from exc
        except BotoCoreError as exc:
            raise self._fail(f"cannot delete SSM parameter {name}", exc) from exc
        self._parameters.discard(name)

    # -- Provider interface --------------------------------------------------------------------

    def launch_request(
        self, job_id: str, names: Sequence[str], slots: int, options: AWSProviderOptions | None = None
    ) -> dict[str, Any]:
        """The ``RunInstances`` parameters for ``names`` (module docstring)."""
        o = options or self.options
        token = self._read_token() if o.token_delivery == "user_data" else None
        user_data = agent_user_data(o, self.context, job_id, names, slots, token=token)
        if len(user_data.encode()) > USER_DATA_LIMIT:
            raise RuntimeError(
                f"aws: the user data for {len(names)} VM(s) is {len(user_data.encode())} bytes, over EC2's "
                f"{USER_DATA_LIMIT}: shorten setup_command (or the TLS CA file)"
            )
        type_tag = {"varuna-vm-type": o.instance_type}
        request: dict[str, Any] = {
            "ImageId": o.image_id,
            "InstanceType": o.instance_type,
            "MinCount": 1,
            "MaxCount": len(names),
            "SubnetId": o.subnet_id,
            "UserData": user_data,
            "InstanceMarketOptions": {"MarketType": "spot", "SpotOptions": o.spot_options()},
            "InstanceInitiatedShutdownBehavior": "terminate",
            # IMDSv2 only; one hop: the agent runs on the host, containers on it cannot reach IMDS.
            "MetadataOptions": {
                "HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1,
            },
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": self._tags(job_id, type_tag)},
                {"ResourceType": "volume", "Tags": self._tags(job_id, type_tag)},
            ],
        }
        if o.security_group_ids:
            request["SecurityGroupIds"] = list(o.security_group_ids)
        if o.key_name:
            request["KeyName"] = o.key_name
        if o.instance_profile:
            key = "Arn" if o.instance_profile.startswith("arn:") else "Name"
            request["IamInstanceProfile"] = {key: o.instance_profile}
        if o.root_volume_gb:
            request["BlockDeviceMappings"] = [{
                "DeviceName": self._root_device(o.image_id),
                "Ebs": {"VolumeSize": o.root_volume_gb, "DeleteOnTermination": True},
            }]  # fmt: skip
        return request

    def _root_device(self, image_id: str) -> str:
        images = self.client("ec2").describe_images(ImageIds=[image_id]).get("Images") or []
        return str((images[0] if images else {}).get("RootDeviceName") or "/dev/xvda")

    def create_vms(
        self,
        job_id: str,
        names: Sequence[str],
        slots: int,
        *,
        created_so_far: int,
        type_options: Mapping[str, Any] | None = None,
    ) -> list[NewVM]:
        from botocore.exceptions import BotoCoreError, ClientError

        if not names:
            return []
        o = self._typed(type_options)
        self._ensure_token_parameter(job_id)
        what = f"cannot start {len(names)} {o.instance_type} spot instance(s) in {o.subnet_id}"
        try:
            request = self.launch_request(job_id, names, slots, o)
            reply = self.client("ec2", retries=False).run_instances(**request)
        except ClientError as exc:
            if _error_line(exc)[0] in CAPACITY_CODES:
                return []  # spot capacity is short: the manager says so and asks again later
            raise self._fail(what, exc) from exc
        except BotoCoreError as exc:
            raise self._fail(what, exc) from exc
        now = time.monotonic()
        out: list[NewVM] = []
        for inst in sorted(reply.get("Instances", []), key=lambda i: int(i.get("AmiLaunchIndex", 0))):
            index = int(inst.get("AmiLaunchIndex", 0))
            if index >= len(names):
                continue  # cannot happen (MaxCount); never name one twice
            self._launched[inst["InstanceId"]] = now
            out.append(NewVM(vm_id=names[index], ref={"instance_id": inst["InstanceId"],
                                                      "instance_type": o.instance_type,
                                                      "subnet_id": o.subnet_id}))
        self._name_instances(out)
        return out

    def _name_instances(self, vms: Sequence[NewVM]) -> None:
        """``Name`` and ``varuna-vm`` tags for people and listings; best effort (the manager knows
        its instances by id, Note [VM names on EC2])."""
        from botocore.exceptions import BotoCoreError, ClientError

        for vm in vms:
            try:
                self.client("ec2").create_tags(
                    Resources=[vm.ref["instance_id"]],
                    Tags=[{"Key": "Name", "Value": vm.vm_id}, {"Key": VM_TAG, "Value": vm.vm_id}],
                )
            except (BotoCoreError, ClientError):
                pass

    def delete_vm(self, vm: ProviderVM) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        instance_id = vm.ref.get("instance_id")
        if instance_id:
            try:
                self.client("ec2").terminate_instances(InstanceIds=[instance_id])
            except ClientError as exc:
                if not _error_line(exc)[0].startswith("InvalidInstanceID"):
                    raise self._fail(f"cannot terminate {vm.vm_id} ({instance_id})", exc) from exc
            except BotoCoreError as exc:
                raise self._fail(f"cannot terminate {vm.vm_id} ({instance_id})", exc) from exc
        self._drop_token_parameter(vm.job_id)

    def list_instances(self, job_id: str) -> dict[str, tuple[str, str]]:
        """``{instance id: (state, varuna-vm tag)}`` of this manager's instances of ``job_id``
        (terminated ones stay listed for about an hour)."""
        from botocore.exceptions import BotoCoreError, ClientError

        filters = [{"Name": f"tag:{JOB_TAG}", "Values": [job_id]},
                   {"Name": f"tag:{MANAGER_TAG}", "Values": [self.manager_id]}]
        out: dict[str, tuple[str, str]] = {}
        try:
            for page in self.client("ec2").get_paginator("describe_instances").paginate(Filters=filters):
                for reservation in page.get("Reservations", []):
                    for inst in reservation.get("Instances", []):
                        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                        state = str(inst.get("State", {}).get("Name", ""))
                        out[inst["InstanceId"]] = (state, tags.get(VM_TAG, ""))
        except (BotoCoreError, ClientError) as exc:
            raise self._fail(f"cannot list the instances of job {job_id}", exc) from exc
        return out

    def gone_vms(self, vms: Sequence[ProviderVM]) -> list[str]:
        if not vms or time.monotonic() - self._last_list < self.options.list_interval_s:
            return []
        self._last_list = now = time.monotonic()
        job_id = vms[0].job_id
        listed = self.list_instances(job_id)
        gone: list[str] = []
        for vm in vms:
            instance_id = vm.ref.get("instance_id")
            if not instance_id:
                continue
            state = listed.get(instance_id, ("", ""))[0]
            unlisted = not state and now - self._launched.get(instance_id, float("-inf")) > LISTING_GRACE_S
            if state in GONE_STATES or unlisted:
                gone.append(vm.vm_id)
        self._sweep_orphans(listed, {vm.ref.get("instance_id") for vm in vms})
        return gone

    def _sweep_orphans(self, listed: Mapping[str, tuple[str, str]], known: set[Any]) -> None:
        """Terminate this manager's instances of the job that no VM of the manager stands for,
        seen so in two listings in a row: launched by a manager that died before it recorded
        them, or a VM whose termination failed."""
        from botocore.exceptions import BotoCoreError, ClientError

        suspects = {i for i, (state, _) in listed.items() if state not in GONE_STATES and i not in known}
        orphans = sorted(suspects & self._suspects)
        self._suspects = suspects - set(orphans)
        if orphans:
            try:
                self.client("ec2").terminate_instances(InstanceIds=orphans)
            except (BotoCoreError, ClientError) as exc:
                what = f"cannot terminate unrecorded instance(s) {', '.join(orphans)}"
                raise self._fail(what, exc) from exc

    def close(self) -> None:
        for client in self._clients.values():
            closer = getattr(client, "close", None)
            if closer is not None:
                closer()
        self._clients.clear()

