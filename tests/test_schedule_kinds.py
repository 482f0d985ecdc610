"""Schedule kinds own their facts (Note [Schedule kinds]): the registry, and every fact checked
against the task lists the kind builds and against what the simulator charges."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from simulator.autoconfig import _Planner
from simulator.config import SimConfig, segment_costs
from simulator.engine import simulate
from varuna.core.calibration import Calibration
from varuna.core.schedule import (
    ALL_SCHEDULE_KINDS,
    LIST_SCHEDULE_KINDS,
    SCHEDULE_KINDS,
    get_schedule,
    schedule_kind,
)
from varuna.core.tasks import peak_stashed

ROOT = Path(__file__).resolve().parents[1]


def test_registry():
    assert LIST_SCHEDULE_KINDS == ("varuna", "gpipe", "1f1b", "2bw", "zb-h1", "varuna-zb")
    everything = ("varuna", "gpipe", "1f1b", "2bw", "interleaved", "varuna-interleaved", "zb-h1", "varuna-zb")
    assert SCHEDULE_KINDS == ALL_SCHEDULE_KINDS == everything
    for name in ALL_SCHEDULE_KINDS:
        kind = schedule_kind(name)
        assert kind.name == name and kind.runtime == (name in SCHEDULE_KINDS)
    opportunistic = [schedule_kind(n).opportunistic for n in ALL_SCHEDULE_KINDS]
    assert opportunistic == [True, False, False, False, False, True, False, True]
    with pytest.raises(ValueError, match="kind 'x'; choose one of varuna, gpipe, 1f1b, 2bw, interleaved"):
        schedule_kind("x")


def test_last_1f1b_stage_is_not_charged_a_recompute():
    # The last 1f1b stage runs each B right after its F: no R in its list, so neither the
    # partitioner's costs nor the auto-configurator may charge it one.
    assert get_schedule("1f1b", 3, 4).recomputed(2) == frozenset()
    kind = schedule_kind("1f1b")
    assert not kind.recomputes(3, 2, recompute=True) and kind.recomputes(3, 1, recompute=True)
    full, last = kind.balancing_costs([1.0, 2.0], [0.5, 0.25], [3.0, 4.0], recompute=True)
    assert full == [4.5, 6.25] and last == [4.0, 6.0]
    cal = Calibration.synthetic([0.01, 0.02, 0.03], micro_batch_sizes=(1,))
    assert segment_costs(cal, 1, "1f1b", True)[1] == pytest.approx([0.03, 0.06, 0.09])
    planner = _Planner(cal, "1f1b", True, 2, 1, None)
    assert [planner.stage_recomputes(3, k) for k in range(3)] == [True, True, False]


@pytest.mark.parametrize("name", LIST_SCHEDULE_KINDS)
@pytest.mark.parametrize("recompute", [True, False])
def test_facts_match_the_lists(name, recompute):
    kind = schedule_kind(name)
    for P in range(1, 9):
        for nm in (2, 3, P + 1, 2 * P + 1, 4 * P):  # the facts hold from Nm=2 (kind.recomputes)
            sched = get_schedule(name, P, nm, recompute)
            for k in range(P):
                assert sched.recomputes(k) == kind.recomputes(P, k, recompute=recompute), (P, nm, k)
                assert kind.stash_peak(P, k, nm) == peak_stashed(sched.stages[k]), (P, nm, k)


def _distinct_costs(num_segments: int) -> Calibration:
    # Distinct per-segment costs and R != F, so a wrongly charged R changes the sums.
    fwd = [0.001 * (1 + (7 * i) % 11) for i in range(num_segments)]
    return Calibration.synthetic(fwd, micro_batch_sizes=(1,), bwd_factor=1.9, recompute_factor=0.7)


@pytest.mark.parametrize("name", ALL_SCHEDULE_KINDS)
@pytest.mark.parametrize("recompute", [True, False])
def test_balancing_costs_equal_what_the_simulator_charges(name, recompute):
    """Independent of the kind's own rules: count the R tasks each (virtual) stage really runs,
    take the simulator's busy time per stage, and compare with the balancing costs summed over
    the stage's segments (``full`` before the last virtual stage, ``last`` on it)."""
    kind = schedule_kind(name)
    v = kind.chunks_per_device(2)
    for P in range(2, 9):
        V = P * v
        cal = _distinct_costs(2 * V)
        n = cal.num_segments
        f = [cal.fwd_s(i, 1) for i in range(n)]
        r = [cal.recompute_s(i, 1) for i in range(n)]
        b = [cal.bwd_s(i, 1) for i in range(n)]
        full, last = kind.balancing_costs(f, r, b, recompute=recompute)
        ranges = tuple((2 * s, 2 * s + 1) for s in range(V))
        # Interleaved needs Nm a multiple of P; at Nm == P its last virtual stage recomputes
        # (every forward runs first), which the kind documents as undercharged.
        for nm in (2 * P, 3 * P) if kind.chunked else (2, P + 1, 2 * P + 3):
            if kind.unsupported(P, nm):  # 2bw: Nm >= P
                continue
            cfg = SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=nm, schedule=name,
                            recompute=recompute, chunks=v, stage_segments=ranges, task_overhead_s=0.0,
                            placeholder_s=0.0, step_overhead_s=0.0)
            res = simulate(cal, cfg)
            for k in range(P):
                charged = 0.0
                for ch in range(v):
                    vs = ch * P + k
                    a, e = ranges[vs]
                    F, R, B = sum(f[a:e + 1]), sum(r[a:e + 1]), sum(b[a:e + 1])
                    n_rec = sum(1 for t in res.executed[0][k] if t.op == "R" and getattr(t, "chunk", 0) == ch)
                    charged += nm * (F + B) + n_rec * R
                    balanced = sum((last if vs == V - 1 else full)[a:e + 1])
                    w = round((balanced - F - B) / R)  # how many R per micro-batch balancing charges
                    assert balanced == pytest.approx(F + B + w * R) and w in (0, 1)
                    # Equal to the simulator's F+R+B per micro-batch, except that a stage may keep
                    # one micro-batch's graph (its F directly before its B: gpipe's last one).
                    assert n_rec in (w * nm, w * (nm - 1)), (name, P, nm, k, ch, n_rec)
                    if n_rec == w * nm:
                        assert balanced == pytest.approx((nm * (F + B) + n_rec * R) / nm)
                assert res.stage_busy_s[k] == pytest.approx(charged), (name, P, nm, k)


_KIND_NAMES = set(ALL_SCHEDULE_KINDS)


def _kind_branches(path: Path) -> list[str]:
    """Comparisons against a kind's name (``x == "gpipe"``, ``x in ("gpipe", "1f1b")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(c, ast.Constant) and c.value in _KIND_NAMES for c in consts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_branches_on_kind_names_outside_the_kinds():
    files = sorted((ROOT / "varuna" / "core").glob("*.py")) + sorted((ROOT / "simulator").glob("*.py"))
    found = [hit for path in files for hit in _kind_branches(path)]
    assert not found, "ask schedule_kind(name) instead of comparing names:\n" + "\n".join(found)
