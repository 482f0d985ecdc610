"""The engine's public hooks: step/stop callbacks, $VARUNA_ENGINE_PLUGINS, and the manager's worker
shim that uses the plugins."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from distributed import ROOT
from models import build_model, make_batch

import varuna
from varuna.runtime.plugins import load_plugins, run_plugins

# The run plan's rule (unset / equal / different, per planned field): tests/test_config.py.


# -- step callbacks and plugins ---------------------------------------------------------------------


def _engine(**kw) -> varuna.Engine:
    return varuna.Engine(
        build_model("onecut"),
        varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2, **kw),
        example_batch=make_batch("onecut", 4),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )


def test_step_callbacks_get_the_step_result_with_timings():
    eng = _engine()
    seen = []
    eng.add_step_callback(seen.append)
    try:
        r1 = eng.train_step(make_batch("onecut", 4))
        r2 = eng.train_step(make_batch("onecut", 4))
    finally:
        eng.close()
    assert seen == [r1, r2] and [r.step for r in seen] == [1, 2]
    t = r2.timings
    assert t.num_forwards == 2 and t.fwd_s > 0 and t.bwd_s > 0 and t.sync_s > 0


def test_stop_callbacks_run_when_the_ranks_agree_to_stop():
    eng = _engine(stop_signals=())
    stopped = []
    eng.add_stop_callback(lambda e: stopped.append(e.step_count))
    eng.stop_requested = True
    with pytest.raises(SystemExit) as exit_:
        eng.train_step(make_batch("onecut", 4))
    assert exit_.value.code == 0 and stopped == [1]


def test_plugins_are_called_with_the_engine(tmp_path, monkeypatch):
    (tmp_path / "my_plugin.py").write_text(
        "def attach(engine):\n    engine.plugged = engine.step_count\n"
        "def second(engine):\n    engine.order = getattr(engine, 'plugged', None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VARUNA_ENGINE_PLUGINS", "my_plugin:attach, my_plugin:second")
    eng = _engine()
    eng.close()
    assert eng.plugged == 0 and eng.order == 0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nocolon", r"VARUNA_ENGINE_PLUGINS: bad entry 'nocolon': expected module:function"),
        ("no_such_module_xyz:f", r"VARUNA_ENGINE_PLUGINS: cannot import 'no_such_module_xyz'"),
        ("os.path:no_such_function", r"VARUNA_ENGINE_PLUGINS: os.path has no function 'no_such_function'"),
    ],
)
def test_a_bad_plugin_entry_is_one_clear_line(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        load_plugins(spec)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=message):
        run_plugins(object(), {"VARUNA_ENGINE_PLUGINS": spec})


# -- the manager's worker shim uses the plugins ------------------------------------------------------


def test_worker_shim_attaches_the_reporter_and_checkpoint_interval_without_patching(tmp_path):
    token = tmp_path / "token"
    token.write_text("secret-token-0123456789")
    token.chmod(0o600)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        assert "torch" not in sys.modules and "varuna.runtime.engine" not in sys.modules
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import torch
        import varuna
        from varuna.runtime.engine import Engine
        from models import build_model, make_batch
        assert varuna.Engine is Engine and Engine.__module__ == "varuna.runtime.engine"
        os.kill(os.getpid(), signal.SIGUSR1)   # an eviction notice during start-up
        eng = varuna.Engine(build_model("onecut"),
                            varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2,
                                                checkpoint_dir={str(tmp_path / "ckpt")!r}),
                            example_batch=make_batch("onecut", 4),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        from manager.worker.reporter import WorkerReporter
        assert WorkerReporter.from_env(eng) is eng.manager_reporter is not None
        print("every", eng.checkpointer.every, "stop", eng.stop_requested, flush=True)
        eng.train_step(make_batch("onecut", 4))   # stops (checkpoint, exit 0) after this step
        print("not reached", flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VARUNA_MANAGER": "127.0.0.1:1",
           "VARUNA_MANAGER_TOKEN_FILE": str(token), "VARUNA_CHECKPOINT_EVERY": "7"}
    env.pop("VARUNA_ENGINE_PLUGINS", None)
    run = subprocess.run([sys.executable, "-m", "manager.worker.shim", str(script)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "every 7 stop True" in run.stdout and "not reached" not in run.stdout
    assert (tmp_path / "ckpt" / "step_00000001" / "manifest.json").is_file()


def test_worker_shim_leaves_a_scripts_own_sigusr1_handler_working(tmp_path):
    # Negative control for Note [Early stop]: the shim must not block SIGUSR1, or a script that
    # handles the signal itself (and builds no engine) would never see it.
    token = tmp_path / "token"
    token.write_text("secret-token-0123456789")
    token.chmod(0o600)
    script = tmp_path / "own_handler.py"
    script.write_text(textwrap.dedent("""
        import os, signal, threading
        got = threading.Event()
        signal.signal(signal.SIGUSR1, lambda *_: got.set())
        os.kill(os.getpid(), signal.SIGUSR1)
        print("handled" if got.wait(30) else "blocked", flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VARUNA_MANAGER": "127.0.0.1:1",
           "VARUNA_MANAGER_TOKEN_FILE": str(token)}
    run = subprocess.run([sys.executable, "-m", "manager.worker.shim", str(script)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "handled", run.stdout + run.stderr[-2000:]
