"""The training loop of a live run: failures, notices, growth and spares handled behind one call.

:class:`LiveTrainer` owns the engine of this worker and replaces it when the run changes shape
(docs/live_morph.md): a step that fails because a peer died is redone at the new layout; a
notice (SIGUSR1 by default) makes this worker finish its step, hand its state over and leave; new
workers registered in the store are admitted at the next step boundary; a worker the layout
leaves idle waits (bounded) for the next generation or the end of the job. When only a restart
can go on, it prints ``varuna: live morph impossible: <reason>`` and exits with
``PEER_LOST_EXIT_CODE`` (the supervisor's restart path from the newest checkpoint).

Example (a worker started by the launcher; joiners run the same script)::

    trainer = LiveTrainer(lambda: build_model(), config, example_batch=batch_for(1),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    engine = trainer.run(steps, batch_for)        # batch_for(step) -> the step's whole mini-batch
    if engine is not None:                        # None: this worker left (notice, spare at the end)
        save(engine)
        engine.close()
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from varuna.core.schedule import schedule_kind
from varuna.runtime.config import StepResult, VarunaConfig
from varuna.runtime.engine import Engine
from varuna.runtime.live_morph import (
    DECLARED_DEAD_EXIT_CODE,
    ROOT,
    DeclaredDead,
    LiveMorphFailed,
    LiveWorld,
    MorphReport,
    Phase,
    WaitExpired,
    declare_dead,
    end_job,
    morph,
)
from varuna.runtime.peer_watch import PEER_LOST_EXIT_CODE

__all__ = ["LiveTrainer"]


class LiveTrainer:
    """This worker's engine in a live run, rebuilt in-process whenever the run changes shape.

    ``build_model()``: a fresh model (each new layout materialises its stage on one). The other
    arguments are :class:`~varuna.runtime.engine.Engine`'s. ``live``: default
    ``LiveWorld.join()`` ($VARUNA_LIVE_STORE, $RANK, $WORLD_SIZE, $VARUNA_LIVE_JOIN).
    ``notice_signals``: signals that mean "this worker's VM goes away soon". ``wait_s``: how long
    a spare or joiner waits for work. ``on_phase(phase, generation)``: called as a regroup goes
    ("arrived", "transfer"), e.g. for events. ``morphs``: this worker's :class:`MorphReport` list.
    ``freeze_s``: a member whose heartbeat stood still that long is declared dead and the run
    regroups without it (Note [Live watch]; 0: only the supervisor declares members dead).
    """

    def __init__(
        self, build_model: Callable[[], nn.Module], config: VarunaConfig, *, example_batch: Any,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], loss_fn: Callable | None = None,
        param_init: Callable | None = None, lr_scheduler: Callable | None = None,
        live: LiveWorld | None = None,
        notice_signals: tuple[str, ...] = ("SIGUSR1",), join_window_s: float = 30.0,
        wait_s: float = 3600.0, on_phase: Phase | None = None, backend: str = "gloo",
        freeze_s: float = 30.0,
    ) -> None:
        unsupported = _live_unsupported(config.with_plan(announce=False))  # the engine adopts it again
        if unsupported is not None:
            raise ValueError(unsupported)
        # LiveWorld.join freezes the imports out of the garbage collector (a morph's collection
        # then walks only what the run made: docs/live_morph.md, Benchmark).
        self.live = live or LiveWorld.join(backend=backend, freeze_s=freeze_s)
        # the notice signals are this trainer's: no engine may take them for a graceful stop
        # The peer watch's answer to a silent peer is exit 75 (the restart path); here a lost peer
        # surfaces as a failed step, and a frozen one is declared dead by the live world's
        # heartbeat watch, which severs the groups so that the step fails (Note [Live watch]).
        config = dataclasses.replace(config, stop_signals=tuple(s for s in config.stop_signals
                                                                 if s not in notice_signals),
                                     timeouts=dataclasses.replace(config.timeouts, peer_s=0))
        self._build_model, self.config = build_model, config
        self._engine_args = {"example_batch": example_batch, "optimizer": optimizer, "loss_fn": loss_fn,
                             "param_init": param_init, "lr_scheduler": lr_scheduler}
        self._opts = {"join_window_s": join_window_s, "backend": backend, "on_phase": on_phase}
        self.wait_s = wait_s
        self.morphs: list[MorphReport] = []
        self._registered: list[tuple[str, Any, str]] = []
        self.failed_steps: list[int] = []
        """Steps that failed here and were redone (the step in flight of a lost peer)."""
        self.left = False
        self._leaving = False
        self._last_failure: int | None = None
        self.engine: Engine | None = None
        self._planned: tuple[int, int] | None = None  # the P×D the environment's run plan fits
        if not self.live.joining:
            self.engine = self._attach(Engine(build_model(), config, **self._engine_args))
            self._planned = (self.engine.layout.P, self.engine.layout.D)
        if threading.current_thread() is threading.main_thread():
            for name in notice_signals:
                signal.signal(getattr(signal, name), self._on_notice)

    # ------------------------------------------------------------------ public

    def register_state(self, name: str, obj: Any, *, scope: str = "global") -> None:
        """``Engine.register_state`` on this worker's engine and on every engine a morph builds
        (a joiner's too): global state goes to the new engine from a holder's record, so a
        ``StatefulBatches`` rewinds to the committed step and the redone step gets its batch again.

        Example::

            trainer.register_state("data", data)
            trainer.run(steps, data.batch_for)
        """
        self._registered.append((name, obj, scope))
        if self.engine is not None:
            self.engine.register_state(name, obj, scope=scope)

    def step(self, batch_for: Callable[[int], Any]) -> StepResult | None:
        """Run the next step, ``batch_for(committed step + 1)``, redoing it after a lost peer and
        waiting while a spare or joiner. None: this worker has left the run (or the job ended).

        Example::

            while (r := trainer.step(batch_for)) is not None and r.step < steps:
                print(r.step, r.loss)
        """
        while not self.left:
            if self.engine is None:
                self._wait_for_work()
                continue
            step = self.engine.committed_step + 1
            try:
                result = self.engine.train_step(batch_for(step))
            except (RuntimeError, TimeoutError) as e:  # a peer lost inside the step; redone at the new layout
                # One line; and leave the except block first: its traceback's frames hold group handles.
                failure = " ".join(str(e).split())
            else:
                failure = None
            if failure is not None:
                self._after_failure(step, failure)
                continue
            if self.engine.agreed_stop:
                self.engine.agreed_stop = False
                self._at_boundary()
            return result
        return None

    def run(self, steps: int, batch_for: Callable[[int], Any],
            on_step: Callable[[StepResult], None] | None = None) -> Engine | None:
        """Train until ``steps`` steps are committed; returns the engine (None: this worker left).

        Example::

            engine = trainer.run(100, batch_for, on_step=lambda r: print(r.step, r.loss))
        """
        while not self.left and (self.engine is None or self.engine.committed_step < steps):
            r = self.step(batch_for)
            if r is not None and on_step is not None:
                on_step(r)
        if self.engine is not None and self.engine.layout.rank == 0:
            end_job(self.live.store)  # spares and waiting joiners leave
        self.live.close()  # heartbeat thread joined (it beats "exit": nobody takes it for frozen)
        return self.engine

    # ------------------------------------------------------------------ internals

    def _on_notice(self, signum, frame) -> None:
        # Only a flag: the step in flight finishes, the hook of the next agreement says so.
        self._leaving = True

    def _attach(self, engine: Engine) -> Engine:
        engine.boundary_hook = self._boundary_hook
        for name, obj, scope in getattr(self, "_registered", ()):
            engine.register_state(name, obj, scope=scope)
        live, members = self.live, list(self.live.members)
        # Note [Live watch]: a member of this generation declared dead severs its groups, so this
        # process's main thread fails out of any wait on it (and peers blocked on this one too).
        live.guard("engine", members, list(engine._groups.created))
        # An in-flight checkpoint waiting for a dead writer's part gives up at once (the previous
        # complete checkpoint stays the newest): old-layout ranks of members known dead.
        engine.checkpointer.lost_writers = lambda: {r for r, m in enumerate(members)
                                                    if m in live.known_dead()}
        # A new generation of the live run: no save of an older one commits from now on (a
        # member cut off mid-save may still reach the store: Note [Checkpoint fence]).
        engine.checkpointer.start_generation(live.generation)
        return engine

    def _build(self, P: int, D: int) -> Engine:
        cfg = dataclasses.replace(self.config, pipeline_depth=P, data_parallel=D,
                                  checkpoints=dataclasses.replace(self.config.checkpoints, resume=False))
        if (P, D) != self._planned:
            # The run plan's stage ranges, shares and speeds were sized for the launch layout
            # (Note [Run plan]); a new P×D balances its own split. The engine reads the plan from
            # the environment, so this process drops those variables too.
            cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(
                cfg.pipeline, stage_ranges=None, replica_shares=None, stage_speeds=None))
            for name in _LAYOUT_PLAN_ENV:
                os.environ.pop(name, None)
            self._planned = (P, D)
        return self._attach(Engine(self._build_model(), cfg, **self._engine_args))

    def _boundary_hook(self) -> bool:
        """Before each step's agreement: does this rank ask for a regroup at this boundary?"""
        live, asked = self.live, False
        if self._leaving:
            live.store.set(f"{ROOT}gen{live.generation}/leave/{live.member}", "1")
            asked = True
        if live.rank == 0 and live.store.add(f"{ROOT}joins", 0) > live.joins_consumed:
            asked = True  # new workers wait to be admitted
        return asked

    def _at_boundary(self) -> None:
        """Every rank agreed to stop after this step: a regroup (notice, joiners) or a real stop.
        The first rank to decide writes the answer; all follow it."""
        live, engine = self.live, self.engine
        store, pre = live.store, f"{ROOT}gen{live.generation}/"
        leave = any(store.check([f"{pre}leave/{m}"]) for m in live.members)
        grow = store.add(f"{ROOT}joins", 0) > live.joins_consumed
        proposal = "regroup" if leave or grow else "stop"
        decision = store.compare_set(f"{pre}after/{engine.step_count}", "", proposal).decode()
        if decision == "stop":
            end_job(store)
            engine._stop()  # stop callbacks (checkpoint), close, exit
        self._morph(leaving=self._leaving)

    def _after_failure(self, step: int, error: str) -> None:
        print(f"varuna: member {self.live.member}: step {step} failed ({error[:160]}); regrouping",
              file=sys.stderr, flush=True)
        again = self._last_failure == step and self.morphs and not self.morphs[-1].lost
        if again:  # the same step failed again although nobody was lost: not a peer failure
            raise RuntimeError(error)
        self.failed_steps.append(step)
        self._last_failure = step
        self._morph(leaving=self._leaving, failed=True)

    def _wait_for_work(self) -> None:
        if self._leaving:  # a spare or joiner with a notice just goes
            self.live.close()  # before its own dead key, which its watch would take for a verdict
            declare_dead(self.live.store, self.live.member)
            self.left = True
            return
        self._morph(leaving=False)

    def _morph(self, *, leaving: bool, failed: bool = False) -> None:
        held, self.engine = self.engine, None
        try:
            new = morph(self.live, held, self._build, leaving=leaving,
                        wait_s=self.wait_s if held is None else None, failed=failed, **self._opts)
        except LiveMorphFailed as e:
            if isinstance(e, DeclaredDead) or self.live.declared_dead():
                # frozen while the others went on: not the restart path, just this process goes
                print(f"varuna: {' '.join(str(e).split())}; exiting", file=sys.stderr, flush=True)
                raise SystemExit(DECLARED_DEAD_EXIT_CODE) from None
            self._morph_failed(e)
            return
        finally:
            del held
        if new is not None and self.live.last_morph is not None:
            self.morphs.append(self.live.last_morph)
        self.engine = new
        self.left = self.live.finished or self.live.role == "gone"

    def _morph_failed(self, e: LiveMorphFailed) -> None:
        if isinstance(e, WaitExpired):
            print(f"varuna: {e}; leaving", file=sys.stderr, flush=True)
            self.left = True
            return
        print(f"varuna: live morph impossible: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        raise SystemExit(PEER_LOST_EXIT_CODE) from None


#: Run-plan variables sized for one P×D (varuna/core/env.py, ``RunPlan``).
_LAYOUT_PLAN_ENV = ("VARUNA_STAGE_RANGES", "VARUNA_REPLICA_SHARES", "VARUNA_STAGE_SPEEDS")


def _live_unsupported(config: VarunaConfig) -> str | None:
    """Why a live morph cannot carry this run's state (one line), or None. The transfer moves
    parameters and optimizer state per segment: 2bw's previous weight version and interleaved
    chunk ranges are not part of it yet."""
    if schedule_kind(config.schedule).weight_versions > 1:
        return (f"live morph does not carry the {config.schedule} schedule's second weight version yet; "
                "use a synchronous schedule (varuna, 1f1b, ...) or the restart path (no live morph)")
    if config.pipeline.chunks > 1:
        return (f"live morph does not support interleaved stages (chunks={config.pipeline.chunks}) yet; "
                "use chunks=1 or the restart path (no live morph)")
    return None
