"""The manager's gRPC service and CLI: token authentication, TLS, the commands and their exit
codes, the generated protobuf modules staying in sync with the .proto, and the conversion between
the wire and the domain's messages (manager/transport/convert.py) losing nothing."""

from __future__ import annotations

import datetime
import filecmp
import ipaddress
import json
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from manager import cli
from manager.common.wire import load_token
from manager.transport import varuna_manager_pb2 as pb
from manager.transport import varuna_manager_pb2_grpc as pb_grpc
from manager.transport.auth import bearer_metadata
from manager.transport.client import ClientConfig, ManagerClient
from manager.transport.server import ManagerServer, ServeConfig

ROOT = Path(__file__).resolve().parents[1]


def _token(path: Path) -> Path:
    path.write_text(secrets.token_urlsafe(32) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def server(tmp_path):
    token = _token(tmp_path / "token")
    srv = ManagerServer(
        ServeConfig(
            db=str(tmp_path / "state.sqlite"),
            listen="127.0.0.1:0",
            token_file=str(token),
            manager={"tick_s": 0.05},
        )
    )
    srv.start()
    yield srv, token
    srv.stop()
    # The jobs here ask for no VM (max_created 0): nothing may have been started.
    assert not list((tmp_path / "state.sqlite.d").glob("*/*/agent.log"))


def _jobspec(tmp_path: Path, **overrides) -> Path:
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    spec = {
        "name": "demo",
        "script": "train.py",
        "args": ["--steps", "3"],
        "global_batch_size": 8,
        "checkpoint_dir": "ckpt",
        "max_vms": 2,
        "target_steps": 3,
        "provider": "local",
        # no VM will ever be created: the test must not start agents
        "provider_options": {"max_created": 0},
    }
    spec.update(overrides)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    return path


# -- the wire and the domain -----------------------------------------------------------------------

# Every domain message and the wire message it travels as; the wire's extra fields are listed.
_PAIRS = [
    ("RegisterVM", "RegisterVMRequest", set()),
    ("Registered", "RegisterVMReply", set()),
    ("WorkerState", "WorkerState", set()),
    ("PreemptNotice", "PreemptNotice", set()),
    ("VMHeartbeat", "VMHeartbeatRequest", {"has_notice"}),  # notice None <-> has_notice false
    ("WorkerLaunch", "WorkerLaunch", set()),
    ("ProfileOrder", "ProfileOrder", set()),
    ("Orders", "Orders", set()),
    ("CalibrationReport", "ReportCalibrationRequest", set()),
    ("CalibrationReply", "ReportCalibrationReply", set()),
    ("WorkerHeartbeat", "WorkerHeartbeatRequest", set()),
    ("WorkerStatus", "WorkerInfo", set()),
    ("VMStatus", "VMStatus", set()),
    ("ThroughputPoint", "ThroughputPoint", set()),
    ("PoolShare", "PoolShare", set()),
    ("JobStatus", "JobStatus", set()),
]


@pytest.mark.parametrize("domain_name, wire_name, wire_only", _PAIRS)
def test_domain_messages_have_the_wires_fields(domain_name, wire_name, wire_only):
    """A field added to the .proto (or a domain message) without the other breaks this: the
    conversions copy field by field, by name."""
    import dataclasses

    from manager.domain import messages

    domain = {f.name for f in dataclasses.fields(getattr(messages, domain_name))}
    wire = {f.name for f in getattr(pb, wire_name).DESCRIPTOR.fields}
    assert domain == wire - wire_only, (domain ^ (wire - wire_only))


def test_every_message_crosses_the_wire_unchanged():
    """Each conversion against values that are all set (not defaults), both ways it is used."""
    from manager.domain import messages as m
    from manager.domain.errors import ErrorKind
    from manager.transport import convert
    from manager.transport.server import STATUS_OF_ERROR

    notice = m.PreemptNotice(event_id="e", event_type="Preempt", not_before="soon", description="d")
    beat = m.VMHeartbeat(vm_id="v", agent_instance="i", generation=3, free_port=99, notice=notice,
                         workers=(m.WorkerState(rank=1, pid=7, running=False, exit_code=-9),))
    wire_notice = pb.PreemptNotice(event_id="e", event_type="Preempt", not_before="soon", description="d")
    wire = pb.VMHeartbeatRequest(vm_id="v", agent_instance="i", generation=3, free_port=99, has_notice=True,
                                 notice=wire_notice,
                                 workers=[pb.WorkerState(rank=1, pid=7, running=False, exit_code=-9)])
    assert convert.heartbeat_from_pb(wire) == beat
    wire.has_notice = False  # a notice message left over but not flagged is no notice
    assert convert.heartbeat_from_pb(wire).notice is None
    reg = m.RegisterVM(vm_id="v", job_id="j", agent_instance="i", hostname="h", address="a", slots=2, pid=5)
    assert convert.register_from_pb(pb.RegisterVMRequest(**vars(reg))) == reg
    report = m.CalibrationReport(vm_id="v", agent_instance="i", attempt=2, ok=False, calibration_json="{}",
                                 error="boom", wall_s=1.5)
    assert convert.report_from_pb(pb.ReportCalibrationRequest(**vars(report))) == report
    hb = m.WorkerHeartbeat(**{f: i + 1 for i, f in enumerate(m.WorkerHeartbeat.__dataclass_fields__)
                              if f not in ("job_id", "vm_id")}, job_id="j", vm_id="v")
    assert convert.worker_heartbeat_from_pb(pb.WorkerHeartbeatRequest(**vars(hb))) == hb
    orders = m.Orders(action=m.Action.PROFILE, generation=4, stop_timeout_s=6.0, heartbeat_interval_s=0.5,
                      training=True, leave=True, kill=[2, 3],
                      workers=[m.WorkerLaunch(rank=0, argv=("-m", "x"), env={"K": "v"}, cwd="/w")],
                      profile=m.ProfileOrder(attempt=1, argv=("--model", "m:f"), env={"E": "1"}, cwd="/p",
                                             timeout_s=60.0))
    out = convert.orders_to_pb(orders)
    assert pb.Orders.Action.Name(out.action) == "PROFILE" and (out.generation, list(out.kill)) == (4, [2, 3])
    assert (out.stop_timeout_s, out.heartbeat_interval_s, out.training, out.leave) == (6.0, 0.5, True, True)
    launched = [(w.rank, list(w.argv), dict(w.env), w.cwd) for w in out.workers]
    assert launched == [(0, ["-m", "x"], {"K": "v"}, "/w")]
    assert (out.profile.attempt, list(out.profile.argv), dict(out.profile.env), out.profile.timeout_s) == (
        1, ["--model", "m:f"], {"E": "1"}, 60.0)
    assert {a.name for a in m.Action} == set(pb.Orders.Action.keys())
    assert not convert.orders_to_pb(m.Orders()).HasField("profile")
    status = m.JobStatus(
        job_id="j", name="n", state="running", message="msg", generation=2, generation_state="running",
        pipeline_depth=2, data_parallel=3, micro_batch_size=4, step=5, target_steps=6, created=7.0,
        provider="local", checkpoint_dir="/c", calibration_state="done", calibration="c",
        vms=[m.VMStatus(vm_id="v", state="up", health="healthy", slots=1, address="a", heartbeat_age_s=0.5,
                        in_generation=True, detail="d", agent_pid=9,
                        workers=[m.WorkerStatus(rank=1, pid=2, running=True, exit_code=0, stage=1, replica=0,
                                                step=5, fwd_s=0.1, bwd_s=0.2)])],
        throughput=[m.ThroughputPoint(step=5, generation=2, time=8.0, samples_per_s=9.0, loss=1.0,
                                      pipeline_depth=2, data_parallel=3)],
        pool=m.PoolShare(vm_type="fast", vm_count=2, weight=1.0, allocation="a", predicted_samples_per_s=3.0,
                         measured_samples_per_s=2.0, round=4, policy="las"),
    )
    assert_same(convert.status_to_pb(status), status)
    assert not convert.status_to_pb(m.JobStatus(job_id="j", name="n", state="s")).HasField("pool")
    assert set(STATUS_OF_ERROR) == set(ErrorKind)  # every refusal has its status code


def assert_same(wire, obj) -> None:
    """Every field of the dataclass ``obj`` equals the wire message's, nested ones included."""
    import dataclasses

    for f in dataclasses.fields(obj):
        value, got = getattr(obj, f.name), getattr(wire, f.name)
        if dataclasses.is_dataclass(value):
            assert wire.HasField(f.name), f.name
            assert_same(got, value)
        elif isinstance(value, list):
            assert len(got) == len(value), f.name
            for g, v in zip(got, value):
                assert_same(g, v)
        else:
            assert got == value, (f.name, got, value)


# -- proto ----------------------------------------------------------------------------------------


def test_generated_modules_match_the_proto(tmp_path):
    """The committed *_pb2*.py must be what grpc_tools.protoc makes of the committed .proto."""
    from grpc_tools import protoc

    pkg = Path("manager") / "transport"
    (tmp_path / pkg).mkdir(parents=True)
    shutil.copy(ROOT / pkg / "varuna_manager.proto", tmp_path / pkg)
    include = str(Path(protoc.__file__).parent / "_proto")
    rc = protoc.main(
        [
            "protoc",
            f"-I{tmp_path}",
            f"-I{include}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(tmp_path / pkg / "varuna_manager.proto"),
        ]
    )
    assert rc == 0
    for name in ("varuna_manager_pb2.py", "varuna_manager_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / pkg / name, ROOT / pkg / name, shallow=False), (
            f"{pkg / name} is stale: run `python -m grpc_tools.protoc -I. --python_out=. "
            "--grpc_python_out=. "
            "manager/transport/varuna_manager.proto` in the repository root"
        )


# -- authentication -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        (("authorization", "Bearer wrong-token-000000000000"),),
        (("authorization", "bearer"),),
        (("x-other", "1"),),
    ],
)
def test_rpcs_without_the_right_token_are_refused(server, metadata):
    srv, _ = server
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.VarunaManagerStub(channel)
        calls = [
            lambda: stub.GetStatus(pb.GetStatusRequest(), metadata=metadata, timeout=5),
            lambda: stub.SubmitJob(pb.SubmitJobRequest(), metadata=metadata, timeout=5),
            lambda: stub.VMHeartbeat(pb.VMHeartbeatRequest(vm_id="x"), metadata=metadata, timeout=5),
            lambda: stub.WorkerHeartbeat(pb.WorkerHeartbeatRequest(), metadata=metadata, timeout=5),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_right_token_is_accepted(server):
    srv, token = server
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.VarunaManagerStub(channel)
        reply = stub.GetStatus(pb.GetStatusRequest(), metadata=bearer_metadata(load_token(token)), timeout=5)
        assert list(reply.jobs) == []


def test_token_file_must_be_private_and_long(tmp_path):
    weak = tmp_path / "weak"
    weak.write_text("short")
    weak.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16"):
        load_token(weak)
    shared = _token(tmp_path / "shared")
    shared.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_token(shared)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_tls(tmp_path):
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    token = _token(tmp_path / "token")
    srv = ManagerServer(
        ServeConfig(
            db=str(tmp_path / "s.sqlite"),
            listen="127.0.0.1:0",
            token_file=str(token),
            tls_cert=str(cert),
            tls_key=str(key),
        )
    )
    srv.start()
    try:
        config = ClientConfig(address=f"localhost:{srv.port}", token=load_token(token), tls_ca=str(cert))
        with ManagerClient(config) as client:
            assert client.status() == []
        with ManagerClient(
            ClientConfig(address=config.address, token="wrong-token-000000000000", tls_ca=str(cert))
        ) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.status()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:  # plain text to a TLS port fails
            stub = pb_grpc.VarunaManagerStub(channel)
            with pytest.raises(grpc.RpcError):
                stub.GetStatus(pb.GetStatusRequest(), metadata=bearer_metadata(load_token(token)), timeout=3)
    finally:
        srv.stop()


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_submit_status_events_cancel(server, tmp_path, capsys):
    srv, token = server
    common = ["--manager", srv.address, "--token-file", str(token)]
    assert cli.main(["submit", str(_jobspec(tmp_path)), *common]) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.startswith("demo-")
    assert cli.main(["status", job_id, *common]) == 0
    out = capsys.readouterr().out
    assert f"job {job_id}" in out and "[pending]" in out and "step 0/3" in out
    assert "calibration none: fallback rule" in out
    assert cli.main(["status", job_id, "--json", *common]) == 0
    status = json.loads(capsys.readouterr().out)[0]
    assert status["job_id"] == job_id and status["target_steps"] == "3"
    assert status["calibration_state"] == "none"
    assert cli.main(["cancel", job_id, *common]) == 0
    assert "cancelling" in capsys.readouterr().out
    assert cli.main(["events", job_id, "--json", *common]) == 0
    kinds = [json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()]
    assert kinds[0] == "submitted" and "cancel-requested" in kinds
    stored = srv.store.job(job_id).spec
    assert stored["script"] == str(tmp_path / "train.py")  # resolved against the spec's directory
    assert stored["checkpoint_dir"] == str(tmp_path / "ckpt")


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["submit", "{missing}"], "cannot read job spec"),
        (["submit", "{bad_json}"], "not valid JSON"),
        (["submit", "{bad_field}"], "unknown field(s) gpus"),
        (["submit", "{bad_value}"], "'max_vms' must be an integer >= 1"),
        (["status", "no-such-job"], "no job 'no-such-job'"),
        (["cancel", "no-such-job"], "no job 'no-such-job'"),
        (["frobnicate"], "invalid choice"),
        ([], "a command is required"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(server, tmp_path, capsys, argv_tail, message):
    srv, token = server
    paths = {"missing": tmp_path / "nope.toml", "bad_json": tmp_path / "bad.json"}
    paths["bad_json"].write_text("{not json")
    paths["bad_field"] = _jobspec(tmp_path, gpus=3)
    (tmp_path / "job.json").rename(tmp_path / "bad_field.json")
    paths["bad_field"] = tmp_path / "bad_field.json"
    paths["bad_value"] = _jobspec(tmp_path, max_vms=0)
    argv = [a.format(**paths) for a in argv_tail]
    if argv and argv[0] in ("submit", "status", "cancel"):
        argv += ["--manager", srv.address, "--token-file", str(token)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_cli_toml_jobspec(server, tmp_path, capsys):
    srv, token = server
    (tmp_path / "train.py").write_text("")
    (tmp_path / "job.toml").write_text(
        'script = "train.py"\nargs = ["--steps", "3"]\nglobal_batch_size = 8\ncheckpoint_dir = "ck"\n'
        'max_vms = 2\ntarget_steps = 3\n[provider_options]\nmax_created = 0\n[env]\nOMP_NUM_THREADS = "1"\n'
    )
    assert (
        cli.main(["submit", str(tmp_path / "job.toml"), "--manager", srv.address, "--token-file", str(token)])
        == 0
    )
    job_id = capsys.readouterr().out.strip()
    assert srv.store.job(job_id).spec["env"] == {"OMP_NUM_THREADS": "1"}


def test_cli_wait(server, tmp_path, capsys):
    srv, token = server
    common = ["--manager", srv.address, "--token-file", str(token)]
    assert cli.main(["submit", str(_jobspec(tmp_path)), *common]) == 0
    job_id = capsys.readouterr().out.strip()
    # No VM can be created (max_created 0): the job stays pending until the deadline.
    argv = ["wait", job_id, "--until", "running", "--wait-timeout", "0.3", "--poll", "0.05", *common]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"job {job_id} is still pending after 0.3 s" in err, err
    assert cli.main(["cancel", job_id, *common]) == 0
    capsys.readouterr()
    assert cli.main(["wait", job_id, "--poll", "0.05", "--wait-timeout", "60", *common]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"job {job_id} ended cancelled" in err, err
    assert srv.store.job(job_id).state == "cancelled"
    assert cli.main(["wait", "no-such-job", *common]) == 2
    assert "no job 'no-such-job'" in capsys.readouterr().err


def test_cli_wrong_token_and_unreachable_exit_1(server, tmp_path, capsys):
    srv, _ = server
    other = _token(tmp_path / "other")
    assert cli.main(["status", "--manager", srv.address, "--token-file", str(other)]) == 1
    assert "refused the token" in capsys.readouterr().err
    assert cli.main(["status", "--manager", "127.0.0.1:1", "--token-file", str(other), "--timeout", "2"]) == 1
    assert "cannot reach the manager" in capsys.readouterr().err


def test_serve_entry_point_bad_input(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "manager.cli",
            "serve",
            "--db",
            str(tmp_path / "s"),
            "--token-file",
            str(tmp_path / "missing"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "cannot read token file" in run.stderr
