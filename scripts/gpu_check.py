"""The prepared GPU check (issue 31): every CUDA path of the engine in one command, one table.

    scripts/gpu_check.sh --out runs/gpu_table.md            # on the GPU machine (installs torch if needed)
    python3 scripts/gpu_check.py --device cpu --out t.md     # the same rows on CPU (CI runs it)
    python3 scripts/gpu_check.py --rows 1,4                  # rerun some rows only

Each row runs in its own process with its own time limit (a hung or crashed row fails alone, the
others still run) and the whole run keeps within ``--budget`` seconds: a row that would start with
less than a quarter of a minute left is skipped. Progress lines carry timestamps and are
unbuffered; the table (markdown) and its JSON (``--out`` with ``.json``) are rewritten after every
row, so a run killed half way still leaves what it measured. The table is printed at the end; the
exit status is 1 when a row failed, timed out or was skipped (WARN: a performance goal missed, the
path itself works). Rows: scripts/gpu_rows/ (docs/gpu.md says what each checks and why).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_rows import rows  # noqa: E402
from gpu_rows.common import FAIL, SKIP, WARN, RowResult, env_info, log, set_row  # noqa: E402

#: A row is not started with less time than this left in the budget.
MIN_ROW_S = 15.0
DEFAULT_BUDGET_S = {"cuda": 480.0, "cpu": 1500.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--rows", default="", help="comma-separated row numbers (default: all)")
    p.add_argument("--out", type=Path, help="write the table here (markdown) and its JSON beside it (.json)")
    p.add_argument(
        "--budget", type=float, help="seconds for the whole run (default 480 on cuda, 1500 on cpu)"
    )
    p.add_argument("--row-timeout", type=float, help="override every row's time limit (seconds)")
    p.add_argument("--row", type=int, help=argparse.SUPPRESS)  # internal: run one row in this process
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    known = rows()
    try:
        a.selected = [int(x) for x in a.rows.split(",") if x.strip()] or sorted(known)
    except ValueError:
        p.error(f"--rows {a.rows!r}: give row numbers separated by commas, e.g. 1,4")
    unknown = [n for n in a.selected if n not in known]
    if unknown:
        p.error(f"--rows: no row {unknown[0]}; the rows are {', '.join(map(str, sorted(known)))}")
    return a


# ---------------------------------------------------------------------------------------------
# One row, in this process (``--row N --result FILE``)


def run_one(n: int, device: str, result_path: Path) -> int:
    from varuna.core.process import PARENT_PID_VAR, die_with_parent

    if os.environ.get(PARENT_PID_VAR, "").isdigit():
        die_with_parent(int(os.environ[PARENT_PID_VAR]))  # no row outlives a killed check
    set_row(str(n))
    row = rows()[n]
    try:
        res = row.run(device)
        assert isinstance(res, RowResult)
    except Exception as e:  # the row's failure is its result: one line in the table, the trace in the log
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        res = RowResult(FAIL, f"{type(e).__name__}: {first}"[:400])
    result_path.write_text(json.dumps(asdict(res), default=str))
    log(f"{res.status}: {res.summary}")
    return 0


# ---------------------------------------------------------------------------------------------
# The whole check


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return (
            out.stdout.strip() + (" (+ uncommitted changes)" if dirty else "")
            if out.returncode == 0
            else None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _run_row(n: int, device: str, timeout_s: float, work: Path) -> tuple[RowResult, float]:
    """Row ``n`` in a child process (its own session: a timeout kills everything it started)."""
    from varuna.core.process import PARENT_PID_VAR

    result = work / f"row{n}.json"
    cmd = [
        sys.executable,
        "-u",
        str(Path(__file__).resolve()),
        "--row",
        str(n),
        "--device",
        device,
        "--result",
        str(result),
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        PARENT_PID_VAR: str(os.getpid()),
        "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x),
    }
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        else:  # the row's own children (ranks, the profiler) must not outlive it either
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall = time.perf_counter() - t0
    if rc is None:
        return RowResult(FAIL, f"timed out after {timeout_s:.0f} s (killed with everything it started)"), wall
    if not result.exists():
        return RowResult(FAIL, f"the row's process exited with status {rc} without a result (crash?)"), wall
    return RowResult(**json.loads(result.read_text())), wall


def _table(env: dict, records: list[dict], command: str, total_s: float, done: bool) -> str:
    torch_line = f"torch {env.get('torch')}"
    if env.get("cuda_available"):
        torch_line += f" (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, NCCL {env.get('nccl')})"
    device = (
        f"{env['device']} × {env['devices']} ({env['memory_gib']} GiB, compute capability "
        f"{env['capability']}, driver {env.get('driver') or 'unknown'})"
        if env.get("device")
        else "CPU only"
    )
    lines = [
        "# GPU check" + ("" if done else " (partial: still running or killed)"),
        "",
        f"- command: `{command}`",
        f"- date: {env.get('date')}; host: {env.get('host')}; commit: {env.get('commit') or 'unknown'}",
        f"- device: {device}",
        f"- {torch_line}; python {env.get('python')}",
        f"- wall time: {total_s:.0f} s",
        "",
        "| # | check | status | result | s |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        summary = r["summary"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['row']} | {r['name']} | {r['status']} | {summary} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def _write(out: Path | None, env: dict, records: list[dict], command: str, total_s: float, done: bool) -> str:
    text = _table(env, records, command, total_s, done)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out)
        blob = {
            "env": env,
            "command": command,
            "wall_s": total_s,
            "complete": done,
            "rows": records,
            "passed": done and all(r["status"] not in (FAIL, SKIP) for r in records),
        }
        jtmp = out.with_suffix(".json.tmp")
        jtmp.write_text(json.dumps(blob, indent=1, default=str))
        os.replace(jtmp, out.with_suffix(".json"))
    return text


def check(a: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    set_row("-")
    command = os.environ.get("GPU_CHECK_COMMAND") or shlex.join([sys.argv[0], *sys.argv[1:]])
    env = env_info()
    if a.device == "cuda" and not env["cuda_available"]:
        print(
            "gpu_check: --device cuda but torch sees no GPU (torch "
            f"{env['torch']}); run scripts/gpu_check.sh, which installs the CUDA build, or use --device cpu",
            file=sys.stderr,
        )
        return 2
    env.update(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        host=os.uname().nodename,
        commit=_commit(),
        driver=_driver() if a.device == "cuda" else None,
    )
    log(
        f"torch {env['torch']} on {env.get('device', 'CPU')}; rows {a.selected}; budget "
        f"{a.budget or DEFAULT_BUDGET_S[a.device]:.0f} s"
    )
    budget = a.budget or DEFAULT_BUDGET_S[a.device]
    known, records = rows(), []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for n in a.selected:
            row = known[n]
            left = budget - (time.perf_counter() - t_start)
            if left < MIN_ROW_S:
                res, wall = (
                    RowResult(SKIP, f"not started: {left:.0f} s of the {budget:.0f} s budget left"),
                    0.0,
                )
            else:
                limit = min(a.row_timeout or row.timeout_s(a.device), left)
                log(f"row {n}: {row.name} (limit {limit:.0f} s)")
                res, wall = _run_row(n, a.device, limit, Path(tmp))
            records.append(
                {
                    "row": n,
                    "name": row.name,
                    "status": res.status,
                    "summary": res.summary,
                    "seconds": wall,
                    "metrics": res.metrics,
                }
            )
            log(f"row {n}: {res.status} in {wall:.0f} s")
            _write(a.out, env, records, command, time.perf_counter() - t_start, done=False)
    text = _write(a.out, env, records, command, time.perf_counter() - t_start, done=True)
    print("\n" + text, flush=True)
    bad = [r["row"] for r in records if r["status"] in (FAIL, SKIP)]
    warned = [r["row"] for r in records if r["status"] == WARN]
    log(
        ("all rows passed" if not bad else f"rows {bad} failed or did not run")
        + (f"; rows {warned} missed a performance goal" if warned else "")
    )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:  # one rank of a multi-process row (run by run_local_world)
        from gpu_rows.multi import worker_main

        return worker_main(argv)
    a = parse_args(argv)
    if a.row is not None:
        if a.result is None:
            print("gpu_check: --row needs --result FILE", file=sys.stderr)
            return 2
        return run_one(a.row, a.device, a.result)
    return check(a)


if __name__ == "__main__":
    sys.exit(main())
