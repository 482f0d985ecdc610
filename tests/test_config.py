"""VarunaConfig: the plan rule (Note [Run plan] in varuna/core/env.py) for every planned field, the
defaults applied after adoption, the grouped shape and the flat spellings of earlier releases
(Note [Flat config] in varuna/runtime/config_groups.py), and the test-only negative controls."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest

import varuna
from varuna.core.env import RunPlan
from varuna.core.schedule import DEFAULT_SCHEDULE
from varuna.runtime.config import PLANNED_FIELDS, VarunaConfig, adopt_plan
from varuna.runtime.config_groups import FLAT_FIELDS, GROUPS, PipelineConfig
from varuna.testing.negative_controls import negative_controls, with_negative_controls

# One row per planned field: its variable, the script's value (as a config holds it), a plan with
# the same value written as the planner writes it, and a plan with another value; then how the
# values read in the refusal line (as the variable writes them).
CASES = [
    ("global_batch_size", "VARUNA_GLOBAL_BATCH_SIZE", 32, 32, 64, "32", "64"),
    ("micro_batch_size", "VARUNA_MICRO_BATCH_SIZE", 4, 4, 8, "4", "8"),
    ("schedule", "VARUNA_SCHEDULE", "varuna", "varuna", "1f1b", "varuna", "1f1b"),
    ("chunks", "VARUNA_CHUNKS", 2, 2, 3, "2", "3"),
    ("stage_ranges", "VARUNA_STAGE_RANGES", [(0, 1), (2, 3)], ((0, 1), (2, 3)), ((0, 0), (1, 3)),
     "0-1,2-3", "0-0,1-3"),
    ("replica_shares", "VARUNA_REPLICA_SHARES", (3, 1), (3, 1), (2, 2), "3,1", "2,2"),
    ("stage_speeds", "VARUNA_STAGE_SPEEDS", (1, 2), (1.0, 2.0), (1.0, 1.6), "1,2", "1.0,1.6"),
    ("recompute", "VARUNA_RECOMPUTE", False, False, True, "0", "1"),
    ("recompute_segments", "VARUNA_RECOMPUTE_SEGMENTS", (1, 3), (1, 3), (), "1,3", "none"),
    ("shard_optimizer", "VARUNA_SHARD_OPTIMIZER", True, True, False, "1", "0"),
]
IDS = [c[0] for c in CASES]


def _with(name: str, value) -> VarunaConfig:
    """A config whose planned field ``name`` is ``value`` (None: unset) and the others unset."""
    path = PLANNED_FIELDS[name]
    if len(path) == 1:
        return VarunaConfig(**{name: value})
    group = GROUPS[path[0]]
    return VarunaConfig(**{path[0]: group(**{path[1]: value})})


def _get(cfg: VarunaConfig, name: str):
    path = PLANNED_FIELDS[name]
    return getattr(cfg, name) if len(path) == 1 else getattr(getattr(cfg, path[0]), path[1])


def test_the_cases_cover_every_planned_field_and_every_run_plan_field():
    assert set(IDS) == set(PLANNED_FIELDS) == set(RunPlan.__dataclass_fields__)


@pytest.mark.parametrize("name,var,mine,same,other,shown_mine,shown_other", CASES, ids=IDS)
def test_unset_field_takes_the_plan_and_says_so(name, var, mine, same, other, shown_mine, shown_other):
    cfg = _with(name, None)
    note = adopt_plan(cfg, RunPlan(**{name: same}))
    assert _get(cfg, name) == (list(same) if name == "stage_ranges" else same)
    assert note is not None and "\n" not in note
    shown = RunPlan(**{name: same}).to_env()[var]
    assert note == f"varuna: run plan adopted (the script left them unset): {name}={shown}"


@pytest.mark.parametrize("name,var,mine,same,other,shown_mine,shown_other", CASES, ids=IDS)
def test_same_value_is_accepted_silently(name, var, mine, same, other, shown_mine, shown_other):
    cfg = _with(name, mine)
    before = dataclasses.replace(cfg)
    assert adopt_plan(cfg, RunPlan(**{name: same})) is None
    assert cfg == before  # the script's own value stands, as it wrote it


@pytest.mark.parametrize("name,var,mine,same,other,shown_mine,shown_other", CASES, ids=IDS)
def test_other_value_is_refused_in_one_line_naming_both(name, var, mine, same, other, shown_mine,
                                                        shown_other):
    cfg = _with(name, mine)
    with pytest.raises(ValueError) as err:
        adopt_plan(cfg, RunPlan(**{name: other}))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"the run plan has {name}={shown_other} ({var}) but the script sets {shown_mine}: "
                          f"leave {name} unset in the script"), msg
    assert _get(cfg, name) == mine  # nothing adopted half-way


def test_several_fields_adopted_in_one_line_and_others_kept():
    cfg = VarunaConfig(global_batch_size=32)
    plan = RunPlan(global_batch_size=32, micro_batch_size=8, schedule="1f1b", stage_ranges=((0, 1), (2, 4)))
    note = adopt_plan(cfg, plan)
    assert note == ("varuna: run plan adopted (the script left them unset): micro_batch_size=8, "
                    "schedule=1f1b, stage_ranges=0-1,2-4")
    assert (cfg.micro_batch_size, cfg.schedule, cfg.pipeline.stage_ranges) == (8, "1f1b", [(0, 1), (2, 4)])
    # Nothing planned: nothing changes, nothing said.
    cfg = VarunaConfig(global_batch_size=8)
    assert adopt_plan(cfg, RunPlan()) is None and cfg == VarunaConfig(global_batch_size=8)


def test_defaults_apply_after_adoption_so_they_never_conflict():
    plan = RunPlan(global_batch_size=64, schedule="gpipe")
    cfg = VarunaConfig().with_plan(plan, defaults={"global_batch_size": 32, "micro_batch_size": 4},
                                   announce=False)
    # The plan wins over the script's defaults; a default fills what nobody planned; then the engine's.
    got = (cfg.global_batch_size, cfg.micro_batch_size, cfg.schedule, cfg.pipeline.chunks)
    assert got == (64, 4, "gpipe", 1)
    bare = VarunaConfig(global_batch_size=8, micro_batch_size=2).with_plan(RunPlan(), announce=False)
    assert bare.schedule == DEFAULT_SCHEDULE and bare.pipeline.chunks == 1
    bare.validate()
    # Resolving twice is resolving once: the values from the plan now equal it.
    assert adopt_plan(dataclasses.replace(cfg), plan) is None
    with pytest.raises(ValueError, match=r"^defaults: 'seed' is not a planned field"):
        VarunaConfig().with_plan(RunPlan(), defaults={"seed": 1}, announce=False)


def test_with_plan_leaves_the_callers_config_alone_and_announces_on_rank_0(monkeypatch, capsys):
    for var in ("RANK", "VARUNA_GLOBAL_BATCH_SIZE", "VARUNA_SCHEDULE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VARUNA_SCHEDULE", "1f1b")
    mine = VarunaConfig(global_batch_size=8, micro_batch_size=2)
    cfg = mine.with_plan()
    assert mine.schedule is None and cfg.schedule == "1f1b"
    assert capsys.readouterr().out == "varuna: run plan adopted (the script left them unset): schedule=1f1b\n"
    monkeypatch.setenv("RANK", "1")
    mine.with_plan()
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("field,words", [("global_batch_size", "--global-batch-size M"),
                                         ("micro_batch_size", "auto-config")])
def test_a_batch_size_nobody_set_is_one_line_naming_both_ways(field, words):
    kw = {"global_batch_size": 8, "micro_batch_size": 2}
    del kw[field]
    cfg = VarunaConfig(**kw).with_plan(RunPlan(), announce=False)
    with pytest.raises(ValueError, match=rf"^{field} is not set: .*{words}") as err:
        cfg.validate()
    assert "\n" not in str(err.value)


def test_engine_adopts_an_unset_micro_batch_and_says_so_on_rank_0(monkeypatch, capsys):
    import torch
    from models import build_model, make_batch

    monkeypatch.setenv("VARUNA_MICRO_BATCH_SIZE", "1")
    eng = varuna.Engine(
        build_model("onecut"),
        varuna.VarunaConfig(global_batch_size=4),
        example_batch=make_batch("onecut", 4),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )
    try:
        assert eng.describe()["m"] == 1 and eng.describe()["Nm"] == [4]
        assert eng.config.schedule == DEFAULT_SCHEDULE and eng.config.pipeline.chunks == 1
        out = capsys.readouterr().out
        assert "varuna: run plan adopted (the script left them unset): micro_batch_size=1\n" in out
        assert "_negative_controls" not in eng.describe()
    finally:
        eng.close()
    with pytest.raises(ValueError, match=r"^the run plan has micro_batch_size=1 .* script sets 2: "):
        varuna.Engine(build_model("onecut"), varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2),
                      example_batch=make_batch("onecut", 4), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


# -- the grouped shape and the flat spellings --------------------------------------------------------


def _flat_value(flat: str):
    group, name = FLAT_FIELDS[flat]
    default = getattr(VarunaConfig(), group) if group != "_negative_controls" else negative_controls(
        VarunaConfig())
    current = getattr(default, name)
    special = {"stage_ranges": [(0, 1)], "replica_shares": (2, 1), "stage_speeds": (1.0, 2.0),
               "cut_after": ("a.*",), "checkpoint_snapshot": "disk", "resume": "auto", "plan_cost": "time"}
    if flat in special:
        return special[flat]
    if isinstance(current, bool):
        return not current
    if current is None:
        return "/some/dir" if "dir" in flat else 3
    return type(current)(current * 2 + 1)


@pytest.mark.parametrize("flat", sorted(FLAT_FIELDS))
def test_flat_spelling_builds_the_grouped_config_with_one_warning_naming_the_new_one(flat):
    group, name = FLAT_FIELDS[flat]
    value = _flat_value(flat)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = VarunaConfig(global_batch_size=8, **{flat: value})
    assert [w.category for w in caught] == [DeprecationWarning]
    text = str(caught[0].message)
    assert re.search(rf"flat field '{flat}' is deprecated; use ", text)
    holder = negative_controls(cfg) if group == "_negative_controls" else getattr(cfg, group)
    assert getattr(holder, name) == value
    if group == "_negative_controls":
        assert f"with_negative_controls(config, {name}=...)" in text
        assert cfg == with_negative_controls(VarunaConfig(global_batch_size=8), **{name: value})
    else:
        assert f"VarunaConfig({group}={GROUPS[group].__name__}({name}=...))" in text
        grouped = VarunaConfig(global_batch_size=8, **{group: GROUPS[group](**{name: value})})
        assert cfg == grouped
    # Reading and setting the flat name still work (and warn).
    with pytest.warns(DeprecationWarning, match=flat):
        assert getattr(cfg, flat) == value
    with pytest.warns(DeprecationWarning, match=flat):
        setattr(cfg, flat, getattr(holder, name))


def test_flat_fields_over_a_given_group_and_through_replace_keep_the_rest():
    with pytest.warns(DeprecationWarning):
        cfg = VarunaConfig(checkpoints=varuna.CheckpointConfig(dir="/ckpt", keep=5), checkpoint_every=10)
    assert (cfg.checkpoints.dir, cfg.checkpoints.keep, cfg.checkpoints.every) == ("/ckpt", 5, 10)
    with pytest.warns(DeprecationWarning):
        later = dataclasses.replace(cfg, peer_timeout_s=0)
    assert later.timeouts.peer_s == 0 and later.checkpoints == cfg.checkpoints


def test_groups_are_frozen_so_copies_share_nothing_they_change():
    cfg = VarunaConfig(global_batch_size=8)
    copy = dataclasses.replace(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.checkpoints.every = 3  # type: ignore[misc]
    adopt_plan(copy, RunPlan(chunks=2))
    assert copy.pipeline.chunks == 2 and cfg.pipeline.chunks is None


def test_grouped_config_validates_with_one_line_naming_the_group_field():
    ok = dict(global_batch_size=8, micro_batch_size=2, schedule="varuna", pipeline=PipelineConfig(chunks=1))
    for bad, words in [
        ({"timeouts": varuna.TimeoutConfig(comm_s=0)}, "timeouts.comm_s must be > 0"),
        ({"timeouts": varuna.TimeoutConfig(peer_s=-1)}, "timeouts.peer_s must be >= 0"),
        ({"checkpoints": varuna.CheckpointConfig(snapshot="tape")}, "checkpoints.snapshot must be"),
        ({"numerics": varuna.NumericsConfig(max_nonfinite_steps=-1)}, "numerics.max_nonfinite_steps"),
        ({"pipeline": PipelineConfig(chunks=1, stash_headroom=-1)}, "pipeline.stash_headroom"),
        ({"pipeline_depth": 0}, "pipeline_depth must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)) as err:
            VarunaConfig(**{**ok, **bad}).validate()
        assert "\n" not in str(err.value)


def test_negative_controls_are_not_public_fields():
    public = [f.name for f in dataclasses.fields(VarunaConfig) if not f.name.startswith("_")]
    assert "rng_keyed" not in public and "canonical_reduction" not in public
    assert "_negative_controls" not in repr(VarunaConfig())
    cfg = with_negative_controls(VarunaConfig(), canonical_reduction=False)
    assert negative_controls(cfg).canonical_reduction is False and negative_controls(cfg).rng_keyed is True
    with pytest.raises(TypeError):
        with_negative_controls(VarunaConfig(), keyed=False)
