"""The provider seam (issue 28): adding a provider is one module plus its registration.

A throw-away provider, ``gadget`` (tests/throwaway_provider.py; nothing in the product names it),
goes through what the built-in ones go through: the registry, job-spec validation (its options,
its per-type options, its own check), submit (accepted with its options, a bad one refused in
one line), its agents' notice source, other processes finding it through
``$VARUNA_PROVIDER_MODULES`` and, end to end (slow), a managed job on its pretend VMs: an eviction
announced by its own notice source morphs the job, and the training script never parses
``--schedule`` (the manager's plan reaches it through the run plan).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import throwaway_provider
from throwaway_provider import NOTICE_SOURCE, GadgetOptions, GadgetProvider

from manager.agent.notices import load_notice_source
from manager.domain.context import ManagerConfig
from manager.domain.controller import Manager
from manager.domain.errors import ErrorKind, ManagerError
from manager.domain.jobspec import JobSpec, load_jobspec
from manager.domain.store import Store
from manager.providers.agent_start import agent_argv
from manager.providers.base import ProviderContext
from manager.providers.registry import (
    BUILTIN_MODULES,
    PROVIDER_MODULES_ENV,
    make_provider,
    provider_entry,
    provider_names,
    register_provider,
)
from manager.transport.convert import spec_from_pb, spec_to_pb

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: The providers that ship with varuna (whatever their number), as the registry lists them.
BUILTIN = [n for n in provider_names() if provider_entry(n).module in BUILTIN_MODULES]
BASE = dict(script="/t.py", global_batch_size=8, checkpoint_dir="/c", max_vms=2, target_steps=4)


def gadget_spec(**kw) -> JobSpec:
    kw.setdefault("provider_options", {"flavour": "small"})
    return JobSpec(**{**BASE, "provider": "gadget", **kw})


def test_the_provider_registers_from_its_own_module():
    assert provider_names()[:2] == ("local", "azure") and "gadget" in provider_names()
    entry = provider_entry("gadget")
    assert (entry.options, entry.factory, entry.type_options) == (GadgetOptions, GadgetProvider, ("flavour",))
    assert entry.notice_source == NOTICE_SOURCE == "throwaway_provider:FileNotices"
    assert entry.module == "throwaway_provider"
    with pytest.raises(ValueError, match="^unknown provider 'gcp'; use one of local, azure, .*gadget"):
        provider_entry("gcp")


def test_a_second_provider_of_the_same_name_is_refused():
    class Impostor:
        pass

    with pytest.raises(ValueError, match=r"provider 'gadget' is registered twice \(throwaway_provider and "
                                         r"test_seams_provider\); rename one of them"):
        register_provider(name="gadget", options=GadgetOptions)(Impostor)
    assert provider_entry("gadget").factory is GadgetProvider  # the first one stands


def test_the_decorator_takes_only_a_class():
    """A helper function left between ``@register_provider(...)`` and the class was registered
    as the provider and failed only when a job first asked for it (a CI failure)."""

    def helper(resp):
        return resp

    with pytest.raises(TypeError, match=r"^register_provider\('stray'\) decorates .*helper, not a class$"):
        register_provider(name="stray", options=GadgetOptions)(helper)
    assert "stray" not in provider_names()
    for name in BUILTIN:
        factory = provider_entry(name).factory
        assert isinstance(factory, type) and factory.name == name, (name, factory)


def test_its_job_specs_are_judged_by_its_own_rules(tmp_path):
    spec = gadget_spec()
    assert spec_from_pb(spec_to_pb(spec)).provider_options == {"flavour": "small"}
    types = [{"name": "big", "max_vms": 1, "provider_options": {"flavour": "large"}},
             {"name": "lil", "max_vms": 1}]
    assert [t.name for t in gadget_spec(vm_types=types).vm_type_specs] == ["big", "lil"]
    cases = [
        # its check_job (the local provider's capacity rule: its VMs are processes here)
        (dict(max_vms=1000, procs_per_vm=64), "the gadget provider would run 1000 × 64 workers"),
        # its per-type options: a key it does not take per type, a value its options refuse
        (dict(vm_types=[{"name": "a", "max_vms": 2, "provider_options": {"vm_size": "x"}}]),
         "vm_types a: provider_options vm_size is not a per-type gadget option; use flavour"),
        (dict(vm_types=[{"name": "a", "max_vms": 2, "provider_options": {"flavour": "huge"}}]),
         "vm_types a: provider_options.flavour must be one of small, large, got 'huge'"),
    ]
    for patch, needle in cases:
        with pytest.raises(ValueError) as info:
            gadget_spec(**patch)
        message = str(info.value)
        assert message.startswith("jobspec: ") and needle in message and "\n" not in message, message
    # A job spec file names it like any other provider.
    (tmp_path / "job.toml").write_text(
        'script = "t.py"\nglobal_batch_size = 8\ncheckpoint_dir = "c"\nmax_vms = 2\ntarget_steps = 4\n'
        'provider = "gadget"\nprovider_options = { flavour = "large" }\n'
    )
    assert load_jobspec(tmp_path / "job.toml").provider_options == {"flavour": "large"}


def test_submit_takes_its_options_and_refuses_a_bad_one_in_one_line(tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    store = Store(str(tmp_path / "state.sqlite"))
    try:
        config = ManagerConfig(advertise_address="127.0.0.1:1", token_file=str(token),
                               state_dir=str(tmp_path))
        mgr = Manager(store, config)  # the registry's make_provider, as `varuna-manager serve` has it
        job = mgr.submit(gadget_spec(provider_options={"flavour": "large", "notice_dir": str(tmp_path)}))
        stored = store.job(job)
        assert stored.state == "pending" and json.loads(stored.spec_json)["provider"] == "gadget"
        assert isinstance(mgr.ctx.provider(store.job(job)), GadgetProvider)  # what the manager makes
        for bad, needle in [
            ({"flavour": "huge"}, "provider_options.flavour must be one of small, large, got 'huge'"),
            ({"flavour": "small", "colour": "red"}, "unknown gadget option(s) colour; known: flavour,"),
        ]:
            with pytest.raises(ManagerError) as refused:
                mgr.submit(gadget_spec(provider_options=bad))
            assert refused.value.kind is ErrorKind.INVALID_ARGUMENT
            assert needle in refused.value.message and "\n" not in refused.value.message
        assert [j.job_id for j in store.jobs()] == [job]  # nothing stored for the refused ones
    finally:
        store.close()


def test_its_agents_load_its_notice_source_by_name(tmp_path):
    context = ProviderContext(manager_address="127.0.0.1:1", token_file="/t", state_dir=str(tmp_path))
    provider = make_provider("gadget", {"flavour": "small", "notice_dir": str(tmp_path)}, context)
    argv = agent_argv(provider.agent_start("j", "j-vm1", 1, tmp_path))
    assert argv[argv.index("--notice-source") + 1] == NOTICE_SOURCE
    assert argv[argv.index("--notice-url") + 1] == str(tmp_path) and "--approve-notices" in argv
    source = load_notice_source(NOTICE_SOURCE, url=str(tmp_path), vm_name="j-vm1")
    assert source.poll() == []
    (tmp_path / "j-vm1").write_text("reclaimed for maintenance")
    [notice] = source.poll()
    assert (notice.event_type, notice.description) == ("Reclaim", "reclaimed for maintenance")
    assert source.approve(notice.event_id) and (tmp_path / "j-vm1.approved").exists()
    with pytest.raises(ValueError, match="is not module:Class"):
        load_notice_source("throwaway_provider.FileNotices", url=None, vm_name="v")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_notice_source("throwaway_provider:Nope", url=None, vm_name="v")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != PROVIDER_MODULES_ENV}
    environ.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ,
                          timeout=120, cwd=ROOT)


def test_other_processes_find_it_through_the_environment(tmp_path):
    ask = "from manager.providers.registry import provider_names; print(','.join(provider_names()))"
    assert _python(ask).stdout.split() == [",".join(BUILTIN)]  # control: not imported, not there
    found = _python(ask, **{PROVIDER_MODULES_ENV: "throwaway_provider"})
    assert found.stdout.split() == [",".join([*BUILTIN, "gadget"])], found.stderr
    broken = _python(ask, **{PROVIDER_MODULES_ENV: "no_such_provider_module"})
    assert broken.returncode != 0
    assert broken.stderr.strip().splitlines()[-1].endswith(
        "ValueError: $VARUNA_PROVIDER_MODULES: cannot import no_such_provider_module: "
        "No module named 'no_such_provider_module'"
    )
    # The CLI judges a job spec through the registry: unknown without the module, one line.
    (tmp_path / "job.json").write_text(json.dumps({**BASE, "provider": "gadget",
                                                   "provider_options": {"flavour": "small"}}))
    submit = "import sys; from manager.cli import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", submit, "submit", str(tmp_path / "job.json"), "--manager",
                          "127.0.0.1:1", "--token-file", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"varuna-manager: error: jobspec: unknown provider 'gadget'; use one of {', '.join(BUILTIN)}"
    ], run.stderr


def test_nothing_in_the_product_names_it():
    """The proof that it is one module: no product file mentions it (the registry found it)."""
    kinds = (".py", ".toml", ".sh", ".md", ".json")
    product = [ROOT / "pyproject.toml"] + [
        p for top in ("manager", "varuna", "simulator", "profiler", "scripts", "examples")
        for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in kinds
    ]
    hits = [str(p.relative_to(ROOT)) for p in product
            if any(name in p.read_text(errors="replace") for name in ("gadget", "throwaway_provider"))]
    assert product and hits == []
    assert throwaway_provider.__file__ == str(TESTS / "throwaway_provider.py")


# -- end to end ------------------------------------------------------------------------------------

#: A training script that knows nothing of schedules or of the manager: it parses no arguments at
#: all. Its engine takes the schedule (and the global batch) from the run plan the manager exports.
TOY = '''
import json, os, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import varuna

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.cut = nn.Linear(8, 8), nn.Linear(8, 1), varuna.CutPoint()

    def forward(self, x, y):
        return F.mse_loss(self.b(self.cut(self.a(x))).squeeze(-1), y)

def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, generator=g)

torch.manual_seed(0)
torch.set_num_threads(1)
engine = varuna.Engine(Net(), varuna.VarunaConfig(global_batch_size=8, micro_batch_size=2),
                       example_batch=batch(0), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
out = os.environ["TOY_OUT"]
seen = {"schedule": engine.config.schedule, "planned": os.environ.get("VARUNA_SCHEDULE"),
        "P": engine.layout.P, "D": engine.layout.D, "from": engine.step_count}
with open(os.path.join(out, f"gen{os.environ['VARUNA_GENERATION']}-rank{engine.layout.rank}.json"), "w") as f:
    json.dump(seen, f)
for step in range(engine.step_count + 1, int(os.environ["TOY_STEPS"]) + 1):
    engine.train_step(batch(step))
    time.sleep(0.1)  # the work of a bigger model: leaves time to announce an eviction mid-run
engine.close()
'''


@pytest.mark.slow
def test_a_managed_job_runs_on_its_vms_and_its_notice_source_morphs_it(tmp_path):
    from test_manager_local import (
        ManagerProcess,
        _answers,
        events,
        kinds,
        processes_mentioning,
        status,
        wait_for,
    )

    class GadgetManager(ManagerProcess):
        """``varuna-manager serve`` that finds the gadget through ``$VARUNA_PROVIDER_MODULES`` (with
        tests/ on its path); its agents inherit the environment and import the notice source."""

        def start(self) -> None:
            self.starts += 1
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]),
                   PROVIDER_MODULES_ENV: "throwaway_provider"}
            with open(self.tmp_path / f"manager-{self.starts}.log", "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "manager.cli", "serve", "--db",
                     str(self.tmp_path / "state.sqlite"), "--listen", self.address,
                     "--token-file", str(self.token), *self.extra],
                    stdout=log, stderr=subprocess.STDOUT, env=env,
                )
            with self.client() as client:
                wait_for(lambda: _answers(client), 60, "the manager to answer")

    notices, out = tmp_path / "notices", tmp_path / "out"
    notices.mkdir()
    out.mkdir()
    (tmp_path / "toy.py").write_text(TOY)
    steps = 40
    spec = {
        "name": "gadget-toy", "script": str(tmp_path / "toy.py"), "global_batch_size": 8,
        "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 2, "max_vms": 2, "min_vms": 1,
        "target_steps": steps, "num_segments": 2, "provider": "gadget",
        "provider_options": {"flavour": "small", "max_created": 2, "notice_dir": str(notices)},
        "env": {"TOY_OUT": str(out), "TOY_STEPS": str(steps), "OMP_NUM_THREADS": "1"},
    }
    (tmp_path / "job.json").write_text(json.dumps(spec))
    mp = GadgetManager(tmp_path, "--heartbeat-interval", "0.25", "--heartbeat-timeout", "5",
                       "--stop-timeout", "60", "--orphan-timeout", "30", "--gather-timeout", "60")
    mp.start()
    job = None
    try:
        from manager.transport.convert import spec_to_pb

        with mp.client() as client:
            job = client.submit(spec_to_pb(load_jobspec(tmp_path / "job.json")))
        wait_for(lambda: status(mp, job).step >= 4, 180, "training on the gadget VMs")
        st = status(mp, job)
        assert st.provider == "gadget" and (st.pipeline_depth, st.data_parallel) == (1, 2)
        noticed = next(v.vm_id for v in st.vms if v.in_generation)
        (notices / noticed).write_text("reclaimed for maintenance")  # the gadget's own notice
        wait_for(lambda: "resumed" in kinds(mp, job), 180, "the morph after the gadget's notice")
        wait_for(lambda: status(mp, job).state == "finished", 180, "the job to finish")
        evs = events(mp, job)
        [notice] = [e for e in evs if e.kind == "preempt-notice"]
        assert notice.vm_id == noticed and "Reclaim" in notice.message
        assert (notices / f"{noticed}.approved").exists()  # approved once its workers stopped
        ended = [json.loads(e.data_json) for e in evs if e.kind == "generation-ended"]
        assert [e["graceful"] for e in ended] == [True, True]  # the notice's stop, then the end
        assert status(mp, job).step == steps
        # Every worker of both generations ran the manager's plan: the default schedule, which the
        # script never named (nor parsed), and the layout the manager chose.
        seen = {p.name: json.loads(p.read_text()) for p in out.glob("gen*-rank*.json")}
        assert set(seen) == {"gen1-rank0.json", "gen1-rank1.json", "gen2-rank0.json"}, seen
        assert {(s["schedule"], s["planned"]) for s in seen.values()} == {("varuna", "varuna")}
        assert (seen["gen2-rank0.json"]["P"], seen["gen2-rank0.json"]["D"]) == (1, 1)
        assert seen["gen2-rank0.json"]["from"] >= 4  # resumed from the notice's checkpoint
        wait_for(lambda: not processes_mentioning(job), 30, "every agent and worker to exit")
    finally:
        mp.stop()
        mp.kill_vms()
