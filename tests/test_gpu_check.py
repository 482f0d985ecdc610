"""The prepared GPU check (scripts/gpu_check.sh, issue 31) cannot rot: its ``--device cpu`` mode runs
every row on CPU with tiny sizes, and must pass; a row that hangs is killed and fails alone; bad
usage is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("VARUNA_PEAK_TFLOPS", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_every_row_passes_on_cpu(tmp_path):
    out = tmp_path / "gpu_table.md"
    proc = _run(["--device", "cpu", "--out", str(out)], timeout=1500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    blob = json.loads(out.with_suffix(".json").read_text())
    assert blob["passed"] and blob["complete"]
    assert [r["row"] for r in blob["rows"]] == list(range(1, 9))
    assert all(r["status"] == "PASS" for r in blob["rows"]), [(r["row"], r["summary"]) for r in blob["rows"]]
    table = out.read_text()
    assert table.count("| PASS |") == 8 and "partial" not in table
    assert table in proc.stdout  # printed at the end as written
    # the rows' own evidence, not only their verdicts
    by_row = {r["row"]: r["metrics"] for r in blob["rows"]}
    assert by_row[1]["det_bit_identical"] and by_row[4]["det_weights_equal"]
    assert all(by_row[6]["hops"].values())
    assert by_row[2]["engine_model_flops"] == by_row[2]["model_flops_per_step"]


@pytest.mark.slow
def test_a_hung_row_fails_alone_and_the_exit_status_says_so(tmp_path):
    """Negative control: a row limit too short for any row: the row is killed (with what it started)
    and reported FAILED; the next row still runs; the JSON says the check did not pass."""
    out = tmp_path / "t.md"
    proc = _run(["--device", "cpu", "--rows", "1,8", "--row-timeout", "1", "--out", str(out)], timeout=300)
    assert proc.returncode == 1
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["row"] for r in rows] == [1, 8]
    assert all(r["status"] == "FAIL" and "timed out" in r["summary"] for r in rows)


def test_bad_rows_are_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu",
                           "--rows", "1,99"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no row 99" in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "error" in line]) == 1
