"""The manager's read-only dashboard (manager/dashboard/): its HTTP API over a hand-built state
file (auth, methods, JSON against the store, no writes), the measured Gantt against the GPipe
formula, the server's life cycle, and the page in headless Chromium (slow).

The dashboard during a real job with a kill: tests/test_manager_e2e.py."""

from __future__ import annotations

import json
import socket
import sqlite3
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the dashboard needs varuna[dashboard]")
pytest.importorskip("plotly", reason="the dashboard needs varuna[dashboard]")

from manager.dashboard.gantt import measured_timeline  # noqa: E402
from manager.dashboard.view import DashboardView  # noqa: E402
from manager.dashboard.web import COOKIE, DashboardServer, session_value  # noqa: E402
from manager.domain.context import ManagerConfig  # noqa: E402
from manager.domain.controller import Manager  # noqa: E402
from manager.domain.store import GenerationRecord, ProgressRecord, Store, VMRecord, WorkerStatRecord  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from dashboard_browser import chromium, load_dashboard, missing_browser  # noqa: E402

JOB = "gpt-dash-0a1b2c"
TOKEN = "dashboard-test-token-0123456789"
SPEC = {
    "name": "gpt-dash",
    "target_steps": 40,
    "global_batch_size": 8,
    "schedule": "gpipe",
    "provider": "local",
}
F_S, B_S, M, NM = 0.010, 0.020, 2, 4  # generation 2's measured stage times, m, micro-batches


def _stat(rank: int, stage: int, first: int, end: int) -> WorkerStatRecord:
    return WorkerStatRecord(
        job_id=JOB,
        generation=2,
        rank=rank,
        vm_id=f"v{rank + 1}",
        stage=stage,
        replica=0,
        step=7,
        resumed_from=5,
        time=time.time(),
        fwd_s=F_S,
        bwd_s=B_S,
        recompute_s=0.0,
        micro_batch_size=M,
        first_segment=first,
        end_segment=end,
    )


def build_state(path: Path) -> Store:
    """One job: generation 1 at 2×2 on four VMs, a slow VM and a lost one, a morph to 2×1."""
    now = time.time()
    t0 = now - 60
    store = Store(str(path))
    store.add_job(JOB, SPEC)
    for seq, (state, slow, beat) in enumerate(
        [("up", 0, now - 1.0), ("up", 0, now - 1.0), ("up", 1, now - 1.0), ("gone", 0, t0 + 8)], start=1
    ):
        store.add_vm(
            VMRecord(
                vm_id=f"v{seq}",
                job_id=JOB,
                provider="local",
                seq=seq,
                state=state,
                slots=1,
                created=t0,
                registered=t0 + 1,
                last_heartbeat=beat,
                slow=slow,
                slow_reason="compute 5x the replicas' median" if slow else "",
                gone_reason="no heartbeat for 3.0 s" if state == "gone" else "",
            )
        )
    gens = [(1, 2, 2, ["v1", "v2", "v3", "v4"], t0, "v3 is slow"), (2, 2, 1, ["v1", "v2"], t0 + 20, "")]
    for g, p, d, vms, launched, reason in gens:
        store.add_generation(
            GenerationRecord(
                job_id=JOB,
                generation=g,
                state="running",
                pipeline_depth=p,
                data_parallel=d,
                micro_batch_size=M,
                vms_json=json.dumps(vms),
                master_addr="127.0.0.1",
                master_port=1,
                launched=launched,
                first_step_time=launched + 2,
            )
        )
        if reason:
            store.update_generation(
                JOB, g, state="ended", stop_reason=reason, stop_time=t0 + 15, ended=t0 + 18
            )
    store.add_event(
        JOB,
        "launched",
        "generation 1",
        generation=1,
        when=t0,
        data={"P": 2, "D": 2, "reason": "initial launch"},
    )
    store.add_event(JOB, "slow", "v3 is slow", vm_id="v3", generation=1, when=t0 + 14)
    store.add_event(
        JOB,
        "launched",
        "generation 2: P=2 × D=2 → P=2 × D=1",
        generation=2,
        when=t0 + 20,
        data={"P": 2, "D": 1, "reason": "v3 is slow", "previous": {"generation": 1, "P": 2, "D": 2}},
    )
    store.add_event(
        JOB,
        "resumed",
        "training resumed",
        generation=2,
        when=t0 + 24,
        data={"morph_latency_s": 4.0, "redone_steps": 0},
    )
    for step in range(1, 9):
        g, p, d = (1, 2, 2) if step <= 5 else (2, 2, 1)
        store.add_progress(
            ProgressRecord(
                job_id=JOB,
                generation=g,
                step=step,
                time=t0 + 2 * step + (4 if g == 2 else 0),
                samples_per_s=100.0 * d + step,
                loss=4.0 - 0.1 * step,
                pipeline_depth=p,
                data_parallel=d,
            )
        )
        if step == 7:
            store.flush()  # step 8 and the worker stats stay deferred: only in memory
    store.put_worker_stat(_stat(0, 0, 0, 1))
    store.put_worker_stat(_stat(1, 1, 2, 3))
    return store


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    (tmp / "tok").write_text(TOKEN)
    store = build_state(tmp / "state.sqlite")
    manager = Manager(
        store,
        ManagerConfig(
            advertise_address="127.0.0.1:1", token_file=str(tmp / "tok"), state_dir=str(tmp / "vms")
        ),
    )
    server = DashboardServer(DashboardView.from_manager(manager), token=TOKEN, host="127.0.0.1", port=0)
    server.start()
    try:
        yield server, store, tmp / "state.sqlite"
    finally:
        server.stop()
        store.close()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def fetch(url: str, *, method: str = "GET", headers: dict | None = None) -> tuple[int, dict, bytes]:
    opener = urllib.request.build_opener(_NoRedirect)
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    "path", ["", "api/jobs", f"api/jobs/{JOB}", "static/dashboard.js", "static/plotly.min.js"]
)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": TOKEN},
        {"Cookie": f"{COOKIE}={TOKEN}"},  # the raw token is not the session value
        {"Cookie": f"{COOKIE}={session_value(TOKEN + 'x')}"},
    ],
)
def test_every_route_needs_the_token(served, path, headers):
    server, _, _ = served
    status, hdrs, body = fetch(server.url + path, headers=headers)
    assert status == 401, (path, headers, status)
    assert b"token" in body and JOB.encode() not in body


def test_wrong_token_in_the_address_is_refused(served):
    server, _, _ = served
    status, hdrs, _ = fetch(f"{server.url}?token={TOKEN[:-1]}")
    assert status == 401 and "Set-Cookie" not in hdrs


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["", "api/jobs", f"api/jobs/{JOB}"])
def test_only_get(served, method, path):
    server, _, _ = served
    assert fetch(server.url + path, method=method, headers=BEARER)[0] == 405
    assert fetch(server.url + path, method=method)[0] == 401  # and nothing before the token


def test_token_in_the_address_sets_a_session_cookie_and_is_dropped(served):
    server, _, _ = served
    status, headers, _ = fetch(f"{server.url}?token={TOKEN}")
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    value = cookie.split(";")[0]
    status, headers, body = fetch(server.url + "api/jobs", headers={"Cookie": value})
    assert status == 200 and json.loads(body)["jobs"][0]["job_id"] == JOB
    assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Frame-Options"] == "DENY"


def test_json_matches_the_store(served):
    server, store, path = served
    file_rows = sqlite3.connect(path).execute("SELECT COUNT(*) FROM progress").fetchone()[0]
    status, _, body = fetch(server.url + f"api/jobs/{JOB}", headers=BEARER)
    assert status == 200
    data = json.loads(body)
    job = data["job"]
    gen = store.generation(JOB, 2)
    assert (job["P"], job["D"], job["pxd"]) == (gen.pipeline_depth, gen.data_parallel, "2×1")
    assert (job["name"], job["state"], job["target_steps"]) == ("gpt-dash", "running", 40)
    vms = {v["vm_id"]: v for v in data["vms"]}
    assert list(vms) == [vm.vm_id for vm in store.vms(JOB)]
    assert {k: (v["state"], v["health"], v["slow"], v["in_generation"]) for k, v in vms.items()} == {
        "v1": ("up", "healthy", False, True),
        "v2": ("up", "healthy", False, True),
        "v3": ("up", "slow", True, False),
        "v4": ("gone", "gone", False, False),
    }
    assert vms["v1"]["heartbeat_age_s"] >= 1.0 and vms["v3"]["detail"].startswith("compute 5x")
    assert [(g["generation"], g["pxd"]) for g in data["generations"]] == [(1, "2×2"), (2, "2×1")]
    assert data["morphs"] == [
        {
            "time": pytest.approx(store.events(JOB, kinds=["launched"])[1].time),
            "generation": 2,
            "from": "2×2",
            "to": "2×1",
            "reason": "v3 is slow",
            "latency_s": 4.0,
        }
    ]
    # Every throughput point, the one still deferred (step 8) included...
    assert [(p["step"], p["pxd"], p["samples_per_s"]) for p in data["progress"]] == [
        (s, "2×2" if s <= 5 else "2×1", 100.0 * (2 if s <= 5 else 1) + s) for s in range(1, 9)
    ]
    # ... read without writing it to the file (the dashboard writes nothing).
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM progress").fetchone()[0] == file_rows == 7
    assert [e["id"] for e in data["events"]] == [e.id for e in reversed(store.events(JOB))]
    gantt = data["gantt"]
    assert (gantt["generation"], gantt["pxd"]) == (2, "2×1")
    assert {b["op"] for b in gantt["bars"]} == {"F", "B"} and len(gantt["bars"]) == 2 * 2 * NM
    assert fetch(server.url + "api/jobs/nope", headers=BEARER)[0] == 404


def test_gantt_is_the_gpipe_formula_with_the_measured_times():
    stats = [_stat(0, 0, 0, 1), _stat(1, 1, 2, 3)]
    tl = measured_timeline(
        stats, pipeline_depth=2, data_parallel=1, global_batch_size=M * NM, schedule="gpipe"
    )
    # GPipe without recompute: (Nm + P - 1)·(F + B) (Huang et al.), communication free here.
    assert tl.span_s() == pytest.approx((NM + 2 - 1) * (F_S + B_S))
    assert tl.metadata["Nm"] == NM
    # A stage that has not reported yet: no chart rather than a wrong one.
    assert (
        measured_timeline(stats[:1], pipeline_depth=2, data_parallel=1, global_batch_size=8, schedule="gpipe")
        is None
    )


def test_server_stops_cleanly_and_refuses_a_taken_port(tmp_path):
    store = Store(str(tmp_path / "s.sqlite"))
    view = DashboardView(store, health=lambda vm, now: "healthy")
    first = DashboardServer(view, token=TOKEN, host="127.0.0.1", port=0)
    first.start()
    try:
        second = DashboardServer(view, token=TOKEN, host="127.0.0.1", port=first.port)
        with pytest.raises(
            OSError, match=f"cannot serve the dashboard on 127.0.0.1:{first.port}: .*--dashboard"
        ):
            second.start()
    finally:
        thread = first._thread
        first.stop()
        store.close()
    assert thread is not None and not thread.is_alive()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", first.port)) != 0  # nothing listens any more


@pytest.mark.slow
def test_page_in_headless_chromium(served, tmp_path):
    reason = missing_browser()
    if reason:
        pytest.skip(f"browser test: {reason}")
    server, store, _ = served
    with chromium() as driver:
        seen = load_dashboard(driver, server.url, TOKEN, JOB, screenshot=tmp_path / "dashboard.png")
    assert seen["pxd"].startswith("2×1") and seen["state"] == "running"
    assert "token" not in seen["address"]  # dropped from the address after the cookie was set
    assert seen["morph_labels"] == ["morph 2×2→2×1"]
    assert [r[0] for r in seen["vm_rows"]] == ["v1", "v2", "v3", "v4"]
    assert seen["vm_rows"][2][3] == "slow (excluded)"
    assert seen["event_kinds"] == [e.kind for e in reversed(store.events(JOB))]
    assert seen["event_kinds"][-4:] == ["resumed", "launched", "slow", "launched"]
    assert seen["points"] == {"throughput-chart": 8, "loss-chart": 8}
    assert seen["gantt_bars"] == 2 * 2 * NM
    assert not seen["problem"] and not seen["console_errors"], seen
    assert seen["screenshot"] and (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_refuses_a_bad_dashboard_address_in_one_line(tmp_path, capsys):
    from manager import cli

    token = tmp_path / "tok"
    token.write_text(TOKEN)
    token.chmod(0o600)
    code = cli.main(
        [
            "serve",
            "--db",
            str(tmp_path / "s.sqlite"),
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            str(token),
            "--dashboard",
            "localhost",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "varuna-manager: error: --dashboard 'localhost' is not HOST:PORT (port 0: any free port)"
    ]


@pytest.mark.parametrize("missing", ["aiohttp", "plotly"])
def test_serve_without_the_dashboard_extra_names_it_in_one_line(tmp_path, capsys, monkeypatch, missing):
    from manager import cli

    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    token = tmp_path / "tok"
    token.write_text(TOKEN)
    token.chmod(0o600)
    args = ["serve", "--db", str(tmp_path / "s.sqlite"), "--listen", "127.0.0.1:0"]
    code = cli.main([*args, "--token-file", str(token), "--dashboard", "127.0.0.1:0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        f"varuna-manager: error: --dashboard needs the dashboard extra ({missing}): "
        "pip install 'varuna[dashboard]'"
    ]
    assert not (tmp_path / "s.sqlite").exists(), "refused before the state file is created"


def test_manager_server_with_a_taken_dashboard_port_stops_everything(tmp_path):
    from manager.transport.server import ManagerServer, ServeConfig

    token = tmp_path / "tok"
    token.write_text(TOKEN)
    token.chmod(0o600)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ServeConfig(
            db=str(tmp_path / "s.sqlite"),
            listen="127.0.0.1:0",
            token_file=str(token),
            dashboard=f"127.0.0.1:{port}",
        )
        server = ManagerServer(config)
        with pytest.raises(OSError, match=f"cannot serve the dashboard on 127.0.0.1:{port}"):
            server.start()
    # Everything it had started is stopped and the state file is free for the next manager.
    again = ManagerServer(config)
    again.start()
    try:
        assert again.dashboard is not None and again.dashboard.port == port
        status, _, body = fetch(again.dashboard.url + "api/jobs", headers=BEARER)
        assert status == 200 and json.loads(body) == {"jobs": []}
    finally:
        again.stop()
    assert not again.dashboard._thread


def test_tflops_per_device_from_the_calibrations_flop_count():
    """The job page's TFLOP/s per device is the engine's ``StepResult.tflops``: samples/s × 3 × the
    calibration's forward FLOPs per example / (P×D); MFU when the job's env names a peak; nothing
    (not a zero) without a FLOP count."""
    store = Store(":memory:")
    cal = {"model": {"fwd_flops_per_example": [1e9, 2e9]}}
    store.add_job("with", {**SPEC, "env": {"VARUNA_PEAK_TFLOPS": "50"}}, calibration_json=json.dumps(cal))
    store.add_job("without", SPEC)
    for job in ("with", "without"):
        store.add_progress(ProgressRecord(job_id=job, generation=1, step=1, time=time.time(),
                                          samples_per_s=1000.0, loss=1.0, pipeline_depth=2, data_parallel=2))
    view = DashboardView(store, health=lambda vm, now: "healthy")
    point = view.job("with")["progress"][0]
    assert point["tflops"] == pytest.approx(1000.0 * 3 * 3e9 / 4 / 1e12)
    assert point["mfu"] == pytest.approx(point["tflops"] / 50.0)
    bare = view.job("without")["progress"][0]
    assert bare["tflops"] is None and bare["mfu"] is None
