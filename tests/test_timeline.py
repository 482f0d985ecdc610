"""Timelines: Chrome trace JSON in and out, and the Gantt chart."""

from __future__ import annotations

import json

import pytest

from varuna.core.timeline import Timeline


def _timeline() -> Timeline:
    tl = Timeline(metadata={"config": "2x2"})
    t = 0.0
    for stage in range(2):
        for mb in range(3):
            tl.add(stage=stage, replica=1, op="F", microbatch=mb, start_s=t, end_s=t + 0.010)
            t += 0.010
    tl.add(stage=0, replica=1, op="SEND_ACT", microbatch=0, start_s=0.010, end_s=0.012)
    tl.add(stage=1, replica=1, op="B", microbatch=2, start_s=0.07, end_s=0.09)
    tl.add(stage=1, replica=1, op="AR", microbatch=None, start_s=0.09, end_s=0.1)
    return tl


def test_chrome_trace_format_and_round_trip(tmp_path):
    tl = _timeline()
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(path)
    data = json.loads(path.read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(tl.events)
    b = next(e for e in complete if e["name"] == "B2")
    assert (b["pid"], b["tid"], b["ts"], b["dur"]) == (1, 1, pytest.approx(70000.0), pytest.approx(20000.0))
    send = next(e for e in complete if e["cat"] == "SEND_ACT")
    assert send["tid"] != 0  # sends get their own row so slices never overlap compute
    assert any(e["ph"] == "M" and e["args"].get("name") == "stage 1" for e in data["traceEvents"])
    back = Timeline.from_chrome_trace(path)
    assert back.metadata == {"config": "2x2"}
    assert len(back.events) == len(tl.events)
    for a, b in zip(
        sorted(tl.events, key=lambda e: (e.start_s, e.op)),
        sorted(back.events, key=lambda e: (e.start_s, e.op)),
    ):
        assert (a.stage, a.replica, a.op, a.microbatch) == (b.stage, b.replica, b.op, b.microbatch)
        assert (a.start_s, a.end_s) == (pytest.approx(b.start_s, abs=1e-9), pytest.approx(b.end_s, abs=1e-9))


def test_reads_traces_of_other_writers():
    # A recorder that sets only the essentials: pid = replica, tid = stage, names like "R12".
    data = {
        "traceEvents": [
            {"name": "R12", "ph": "X", "pid": 0, "tid": 3, "ts": 5.0, "dur": 2.0},
            {"name": "step", "ph": "i", "pid": 0, "tid": 3, "ts": 1.0},
        ]
    }
    tl = Timeline.from_chrome_dict(data)
    assert len(tl.events) == 1
    e = tl.events[0]
    assert (e.stage, e.replica, e.op, e.microbatch) == (3, 0, "R", 12)
    assert (e.start_s, e.end_s) == (pytest.approx(5e-6), pytest.approx(7e-6))
    with pytest.raises(ValueError, match="not a Chrome trace"):
        Timeline.from_chrome_dict({"events": []})


def test_span_and_stage_view():
    tl = _timeline()
    assert tl.span_s() == pytest.approx(0.1)
    assert [str(e.microbatch) for e in tl.for_stage(0, replica=1)] == ["0", "1", "2"]
    assert Timeline().span_s() == 0.0


def test_gantt_png(tmp_path):
    pytest.importorskip("matplotlib")
    tl = _timeline()
    path = tmp_path / "gantt.png"
    tl.plot_gantt(path, title="two stages", replica=1)
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(raw) > 5_000
