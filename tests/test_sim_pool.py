"""scripts/sim_pool.py: a tiny trace runs every policy, deterministically, and writes its plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("sim_pool", ROOT / "scripts" / "sim_pool.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sim_pool"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_tiny_trace_every_policy_deterministic(tmp_path, capsys):
    sim = _script()
    out = tmp_path / "r.json"
    assert sim.main(["--tiny", "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    text = capsys.readouterr().out
    assert "avg JCT, agnostic / aware LAS:" in text and "LAS, heterogeneity-aware" in text
    assert (tmp_path / "p.png").stat().st_size > 1000
    first = json.loads(out.read_text())["results"][0]
    assert [r["policy"] for r in first] == ["las", "las-agnostic", "fifo", "makespan", "cost"]
    for r in first:
        assert len(r["jct_h"]) == 4 and all(x > 0 for x in r["jct_h"]) and r["makespan_h"] >= max(r["jct_h"])
    # The cost policy spends the least on VMs (it releases poor-value VMs).
    assert min(first, key=lambda r: r["cost_usd"])["policy"] == "cost"
    # Same seed, same numbers (the solver and the traces are deterministic).
    assert sim.main(["--tiny", "--json", str(out), "--policies", "las,fifo"]) == 0
    again = json.loads(out.read_text())["results"][0]
    keep = ("avg_jct_h", "makespan_h", "cost_usd", "morphs")
    assert [{k: r[k] for k in keep} for r in again] == [{k: r[k] for k in keep} for r in first if
                                                        r["policy"] in ("las", "fifo")]


def test_bad_policy_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        _script().main(["--tiny", "--policies", "las,srtf"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "unknown policy 'srtf'" in err and "\n" not in err
