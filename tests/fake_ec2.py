"""AWS without AWS, for the aws provider's tests: moto's server plays EC2, SSM and IAM over real
HTTP on loopback, a proxy in front of it plays spot capacity, and a runner plays the instances.

- :class:`FakeAWS` starts moto's ``ThreadedMotoServer`` and :class:`CapacityProxy` in front of
  it; boto3 reaches the proxy through ``AWS_ENDPOINT_URL`` (:meth:`FakeAWS.env`), so the code
  under test makes its real SDK calls over HTTP and signs them with the access key it was given.
  The proxy records who called what (the access key id names the caller: the manager, an
  instance's role, the test) and can answer one call with an error of AWS's (``fail_next``).
- Spot capacity (``FakeAWS.capacity``, None: unlimited) is a number of instances that may be
  pending or running at once. EC2's ``RunInstances`` launches as many as it can between
  ``MinCount`` and ``MaxCount``, or none with ``InsufficientInstanceCapacity`` (HTTP 500); moto
  always launches ``MinCount``. The proxy therefore rewrites the request to the count EC2 would
  launch under that capacity, or answers the error itself.
- :class:`InstanceRunner` makes moto's instances do something: every instance that appears
  pending or running gets its user data run as a local process group (``bash``, with
  ``VARUNA_IMDS`` pointing at its own IMDS in :class:`fake_metadata.FakeIMDS` and its paths in a
  temporary directory), and the group is killed with SIGKILL when the instance is terminated,
  stopped or shutting down: an instance that vanishes takes its agent and workers with it.

Nothing here reaches AWS; docs/manager.md (AWS) says what this does and does not show.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import logging
import os
import re
import signal
import subprocess
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import boto3
from fake_metadata import FakeIMDS
from moto.server import ThreadedMotoServer

REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's default account
#: Access key ids: who is calling (the proxy records them).
MANAGER_KEY, INSTANCE_KEY, TEST_KEY = "AKIAMANAGER000000000", "ASIAINSTANCEROLE0000", "AKIATEST000000000000"
ALIVE = ("pending", "running")
GONE = ("shutting-down", "terminated", "stopping", "stopped")
_CREDENTIAL = re.compile(r"Credential=([^/]+)/[^/]+/[^/]+/([^/]+)/")


def _error_xml(code: str, message: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
        f"<Code>{code}</Code><Message>{message}</Message></Error></Errors>"
        "<RequestID>00000000-0000-0000-0000-000000000000</RequestID></Response>"
    ).encode()


@dataclass(frozen=True)
class Call:
    """One API call through the proxy."""

    key: str
    """The access key id that signed it."""
    action: str
    """IAM's name for it, e.g. ``ec2:RunInstances``, ``ssm:GetParameter``."""
    params: Mapping[str, str]
    """The query parameters (EC2, IAM) as sent; {} for JSON protocols (SSM)."""


class CapacityProxy:
    """The proxy in front of moto (module docstring)."""

    def __init__(self, fake: FakeAWS) -> None:
        self.fake = fake
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                outer._handle(self)

            def do_GET(self) -> None:  # noqa: N802
                outer._handle(self)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="capacity-proxy", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        match = _CREDENTIAL.search(h.headers.get("Authorization", ""))
        key, service = (match.group(1), match.group(2)) if match else ("", "")
        target = h.headers.get("X-Amz-Target", "")
        params: dict[str, str] = {}
        if target:  # JSON protocol (SSM): AmazonSSM.GetParameter
            action = target.rsplit(".", 1)[-1]
        else:
            params = dict(urllib.parse.parse_qsl(body.decode(), keep_blank_values=True))
            action = params.get("Action", "")
        call = Call(key=key, action=f"{service}:{action}", params=params)
        self.fake.calls.append(call)
        failure = self.fake.take_failure(call.action)
        if failure is not None:
            return self._reply(h, failure[0], {"Content-Type": "text/xml"}, _error_xml(*failure[1:]))
        if call.action == "ec2:RunInstances":
            with self._lock:  # one launch at a time: the capacity decision holds until moto answered
                body, refused = self._fit_to_capacity(params)
                if refused:
                    return self._reply(h, 500, {"Content-Type": "text/xml"}, _error_xml(
                        "InsufficientInstanceCapacity",
                        f"We currently do not have sufficient {params.get('InstanceType')} capacity in the "
                        "Availability Zone you requested (us-east-1a). Our system will be working on "
                        "provisioning additional capacity."))
                return self._forward(h, body)
        self._forward(h, body)

    def _fit_to_capacity(self, params: dict[str, str]) -> tuple[bytes, bool]:
        """The request moto should get: the count EC2 would launch (module docstring)."""
        want_min, want_max = int(params.get("MinCount", "1")), int(params.get("MaxCount", "1"))
        room = want_max if self.fake.capacity is None else self.fake.capacity - self.fake.alive_count()
        count = min(want_max, room)
        if count < want_min:
            return b"", True
        params = {**params, "MinCount": str(count), "MaxCount": str(count)}
        return urllib.parse.urlencode(params).encode(), False

    def _forward(self, h: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
        conn = http.client.HTTPConnection(self.fake.moto_host, self.fake.moto_port, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "content-length")}
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            hop = ("content-length", "transfer-encoding", "connection", "server", "date")
            keep = {k: v for k, v in resp.getheaders() if k.lower() not in hop}
            self._reply(h, resp.status, keep, data)
        finally:
            conn.close()

    @staticmethod
    def _reply(h: http.server.BaseHTTPRequestHandler, status: int, headers: Mapping[str, str],
               data: bytes) -> None:
        try:
            h.send_response(status)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting


class FakeAWS:
    """moto's server and the capacity proxy (module docstring). ``close()`` stops both."""

    def __init__(self) -> None:
        self.capacity: int | None = None
        self.calls: list[Call] = []
        self._clients: dict[tuple[str, str], object] = {}
        self._image = ""
        self._failures: dict[str, list[tuple[int, str, str]]] = {}
        self._failures_lock = threading.Lock()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        self.moto_host, self.moto_port = self.moto.get_host_and_port()
        self.moto_url = f"http://{self.moto_host}:{self.moto_port}"
        self.reset()
        self.proxy = CapacityProxy(self)
        self.url = self.proxy.url
        self._ec2 = self.client("ec2")

    def reset(self) -> None:
        """Forget every resource (moto's backends live as long as the process: one test's
        instances must not be the next one's)."""
        conn = http.client.HTTPConnection(self.moto_host, self.moto_port, timeout=30)
        try:
            conn.request("POST", "/moto-api/reset")
            conn.getresponse().read()
        finally:
            conn.close()

    def close(self) -> None:
        self.proxy.close()
        self.moto.stop()

    def client(self, service: str, key: str = TEST_KEY):
        """A boto3 client straight to moto (the test's own calls are not recorded); made once."""
        if (service, key) not in self._clients:
            self._clients[service, key] = boto3.client(
                service, region_name=REGION, endpoint_url=self.moto_url, aws_access_key_id=key,
                aws_secret_access_key="secret")
        return self._clients[service, key]

    def env(self, key: str) -> dict[str, str]:
        """Environment for a process whose boto3 should reach the proxy as ``key``, and nothing
        else (no config files, no instance metadata credentials)."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": "secret",
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": "/nonexistent/aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def fail_next(self, action: str, code: str, message: str, status: int = 400) -> None:
        """Answer the next ``action`` (``ec2:RunInstances``) with AWS's error ``code``."""
        with self._failures_lock:
            self._failures.setdefault(action, []).append((status, code, message))

    def take_failure(self, action: str) -> tuple[int, str, str] | None:
        with self._failures_lock:
            queue = self._failures.get(action)
            return queue.pop(0) if queue else None

    def launch_index(self, instance_id: str) -> int:
        """The instance's ``AmiLaunchIndex`` (what IMDS's ``ami-launch-index`` says)."""
        reply = self.client("ec2").describe_instances(InstanceIds=[instance_id])
        return int(reply["Reservations"][0]["Instances"][0]["AmiLaunchIndex"])

    def instances(self) -> dict[str, dict]:
        """Every instance moto knows: id → its DescribeInstances entry."""
        out = {}
        for page in self._ec2.get_paginator("describe_instances").paginate():
            for reservation in page["Reservations"]:
                for inst in reservation["Instances"]:
                    out[inst["InstanceId"]] = inst
        return out

    def alive_count(self) -> int:
        return sum(1 for i in self.instances().values() if i["State"]["Name"] in ALIVE)

    def actions(self, key: str) -> set[str]:
        return {c.action for c in self.calls if c.key == key}

    def network(self) -> dict[str, object]:
        """A VPC, subnet, security group, instance profile and AMI in moto: the aws provider
        options that need them."""
        ec2, iam = self.client("ec2"), self.client("iam")
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24", AvailabilityZone=f"{REGION}a")
        group = ec2.create_security_group(GroupName="varuna", Description="varuna agents", VpcId=vpc)
        iam.create_role(RoleName="varuna-agent", AssumeRolePolicyDocument="{}")
        iam.create_instance_profile(InstanceProfileName="varuna-agent")
        iam.add_role_to_instance_profile(InstanceProfileName="varuna-agent", RoleName="varuna-agent")
        if not self._image:  # one of moto's own AMIs (the same after a reset); listing them is slow
            self._image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        image = self._image
        return {
            "region": REGION,
            "image_id": image,
            "subnet_id": subnet["Subnet"]["SubnetId"],
            "security_group_ids": [group["GroupId"]],
            "instance_profile": "varuna-agent",
        }


class InstanceRunner:
    """Plays the instances (module docstring): a thread that looks at moto's instances every
    ``poll_s`` and starts or kills their process groups. ``close()`` kills every group."""

    def __init__(self, fake: FakeAWS, imds: FakeIMDS, root: Path, env: Mapping[str, str],
                 poll_s: float = 0.5) -> None:
        self.fake, self.imds, self.root, self.poll_s = fake, imds, root, poll_s
        self.env = dict(env)
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="instance-runner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.sync()
            except Exception as exc:  # a moto hiccup: said, and tried again at the next look
                self.errors.append(repr(exc))

    def sync(self) -> None:
        with self._lock:
            for iid, inst in self.fake.instances().items():
                state = inst["State"]["Name"]
                if state in ALIVE and iid not in self.procs:
                    self._start(iid)
                elif state in GONE and iid in self.procs and iid not in self.killed:
                    self._kill(iid)
            for proc in self.procs.values():
                proc.poll()  # reap the boot script (the agent it started lives on in its group)

    def _start(self, iid: str) -> None:
        attr = self.fake.client("ec2").describe_instance_attribute(InstanceId=iid, Attribute="userData")
        script = base64.b64decode(attr["UserData"]["Value"]).decode()
        home = self.root / iid
        home.mkdir(parents=True)
        (home / "user-data.sh").write_text(script)
        env = {**self.env, "VARUNA_IMDS": self.imds.base(iid), "VARUNA_ETC": str(home / "etc"),
               "VARUNA_LOGS": str(home / "logs"), "VARUNA_TEST_INSTANCE": iid}
        with open(home / "boot.log", "wb") as log:
            self.procs[iid] = subprocess.Popen(["bash", str(home / "user-data.sh")], env=env, cwd=home,
                                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)

    def _kill(self, iid: str) -> None:
        self.killed.add(iid)
        try:
            os.killpg(self.procs[iid].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.procs[iid].poll()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            for iid in self.procs:
                if iid not in self.killed:
                    self._kill(iid)
            for proc in self.procs.values():
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass


def base_env(fake: FakeAWS, root: Path) -> dict[str, str]:
    """The environment an instance's user data runs in: this machine's, less anything AWS or
    varuna, plus the instance role's credentials (an access key of its own) and the repository on
    ``PYTHONPATH`` (the setup command installs nothing)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VARUNA_"))}
    env.update(fake.env(INSTANCE_KEY))
    env["PYTHONPATH"] = str(root)
    env["OMP_NUM_THREADS"] = "1"
    return env
