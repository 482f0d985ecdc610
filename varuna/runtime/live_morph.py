"""Morph without a restart: the workers of a live run re-form their groups for a new generation
and keep their state (docs/live_morph.md has the protocol, its findings and the STATUS).

Public API (the launcher/supervisor and :class:`varuna.runtime.live_trainer.LiveTrainer` use it):

- :meth:`LiveWorld.join` ``(address=$VARUNA_LIVE_STORE, *, member=$RANK, world=$WORLD_SIZE,
  timeout_s=60, backend="gloo", joining=$VARUNA_LIVE_JOIN=="1", key=$VARUNA_LIVE_STORE_KEY)``:
  connect to the store the supervisor hosts (proving the run's secret); generation-0 members
  join the first default group, a joiner registers and waits to be admitted at a step boundary.
- :func:`declare_dead` ``(store, member)``: the supervisor saw ``member``'s process exit (any
  code): nobody waits for it any more.
- :func:`request_layout` ``(store, P, D)``: the manager's P×D for the next generations (used when
  it fits the members; otherwise the rule of :func:`varuna.core.live_layout.plan_generation`).
- :func:`end_job` ``(store)``: the job is over; spares and waiting joiners leave (exit 0).
- :func:`recover` ``(engine, model, live)``: after a failed step, regroup (the failure path).
- :func:`morph` ``(live, held, build, *, leaving=False)``: the general transition (failure,
  notice, growth, spare or joiner admitted); returns this worker's new engine or None (it left,
  or it is a spare: ``live.role``). Raises :class:`LiveMorphFailed` (with the reason) when only a
  restart from a checkpoint can go on: exit ``PEER_LOST_EXIT_CODE``.

Store keys (under ``varuna/live/``): ``dead/{m}``, ``plan`` ("P D"), ``done``, ``joins`` (a
counter) and ``join/{i}`` (the i-th joiner's member id), ``generation`` (the newest closed one),
and per generation ``gen{g}/``: ``member/{m}`` (arrival record), ``closed`` (the membership),
``leave/{m}`` (a notice), ``after/{step}`` (the step-boundary decision), ``needs/{m}``,
``xfer/{src}-{dst}`` (transfer metadata), ``pg/`` and ``xpg/`` (the groups' own keys).

Example (what LiveTrainer does after a failed step)::

    live = LiveWorld.join()                      # $VARUNA_LIVE_STORE, $RANK, $WORLD_SIZE
    engine = varuna.Engine(build_model(), config, example_batch=b, optimizer=opt)
    try:
        engine.train_step(batch_for(engine.committed_step + 1))
    except RuntimeError:                         # a peer died in this step
        engine = recover(engine, build_model(), live)   # None: this worker is a spare now
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from varuna.core.env import ProcessEnv, stage_and_replica
from varuna.core.live_layout import plan_generation, transfer_plan
from varuna.runtime.auth_store import AuthStore
from varuna.runtime.engine import Engine
from varuna.runtime.layout import choose_gloo_interface
from varuna.runtime.live_transfer import describe_state, receive_targets
from varuna.runtime.live_watch import DECLARED_DEAD_EXIT_CODE, LiveWatch, sever
from varuna.runtime.optimizer_state import merge_optimizer_states
from varuna.runtime.state_codec import from_json, to_json

__all__ = ["DECLARED_DEAD_EXIT_CODE", "LIVE_JOIN_ENV", "LIVE_STORE_ENV", "LIVE_STORE_KEY_ENV",
           "DeclaredDead", "LiveMorphFailed", "LiveWorld", "MorphReport", "WaitExpired", "declare_dead",
           "end_job", "morph", "recover", "request_layout"]

#: ``host:port`` of the rendezvous store the workers' supervisor hosts (outlives every worker).
LIVE_STORE_ENV = "VARUNA_LIVE_STORE"
#: The store's secret (Note [Store authentication] in varuna/runtime/auth_store.py).
LIVE_STORE_KEY_ENV = "VARUNA_LIVE_STORE_KEY"
#: "1": this worker joins a running job (growth) instead of starting generation 0.
LIVE_JOIN_ENV = "VARUNA_LIVE_JOIN"
ROOT = "varuna/live/"
_POLL_S = 0.02  # how often a waiting member re-reads the store (every wait is bounded)
_MAX_ATTEMPTS = 3  # generations tried in a row when members are lost during the regroup itself

Phase = Callable[[str, int], None]


class LiveMorphFailed(RuntimeError):
    """The members cannot go on without a restart; the message says why (exit, restart path)."""


class WaitExpired(LiveMorphFailed):
    """A member without state (spare, joiner) waited its whole bound for work: it may just leave."""


class DeclaredDead(LiveMorphFailed):
    """This member was declared dead (it was frozen): the run went on without it; exit
    :data:`DECLARED_DEAD_EXIT_CODE`, never the restart path."""


@dataclass(frozen=True)
class MorphReport:
    """What one live morph did, as seen by this worker."""

    generation: int
    lost: list[int]
    old: tuple[int, int] | None
    new: tuple[int, int]
    resumed_after: int
    received_bytes: int
    seconds: float
    joined: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    attempts: int = 1


@dataclass
class LiveWorld:
    """This worker's place in the live run: the store, its stable member id, the generation, the
    working members in rank order (``members[rank]``), the idle ones (``spares``) and who the
    next generation waits for (``expected``)."""

    store: dist.Store
    member: int
    members: list[int]
    generation: int = 0
    timeout_s: float = 60.0
    """Bound of each wait of a regroup (arrivals, state transfer, the new groups)."""
    spares: list[int] = field(default_factory=list)
    expected: list[int] = field(default_factory=list)
    joins_consumed: int = 0
    joining: bool = False
    finished: bool = False
    """The job ended while this worker waited (spare or joiner)."""
    last_morph: MorphReport | None = None
    """What the latest :func:`morph` did, on this worker."""
    collect_due: bool = False
    """The torn-down groups still await their garbage collection (:func:`_collect_if_due`)."""
    watch: LiveWatch | None = None
    """The heartbeat thread (Note [Live watch] in live_watch.py); None: no frozen-peer detection."""
    _guards: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def rank(self) -> int:
        return self.members.index(self.member)

    @property
    def role(self) -> str:
        """"working", "spare", "joining" or "gone" (left, or never admitted)."""
        if self.member in self.members:
            return "working"
        if self.member in self.spares:
            return "spare"
        return "joining" if self.joining else "gone"

    def watched(self) -> list[int]:
        """Every member this one may wait for (working, spare, expected); thread-safe."""
        with self._lock:
            return sorted({*self.members, *self.spares, *self.expected})

    def alive(self, member: int) -> bool:
        """Is ``member``'s heartbeat fresh (False without a watch)?"""
        return self.watch is not None and self.watch.alive(member)

    def known_dead(self) -> set[int]:
        """Members this process has seen declared dead (by the supervisor or a watch)."""
        return set(self.watch.dead) if self.watch is not None else set()

    def declared_dead(self) -> bool:
        """Was this member declared dead (frozen while the others went on)?"""
        return bool(self.store.check([f"{ROOT}dead/{self.member}"]))

    def guard(self, name: str, members: list[int], groups: list) -> None:
        """Sever ``groups`` (weakly held) as soon as one of ``members`` is known dead (Note [Live
        watch]); replaces an earlier guard of the same name."""
        refs = [weakref.ref(g) for g in groups if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER]
        with self._lock:
            self._guards[name] = (tuple(members), refs)

    def unguard(self, name: str) -> None:
        with self._lock:
            self._guards.pop(name, None)

    def sever_guarded(self, dead: set[int] | None = None) -> None:
        """Sever the guarded groups spanning a member of ``dead`` (None: all of them), and forget
        them. Under the lock: the main thread swaps groups only after unguarding the old ones."""
        with self._lock:
            hit = [n for n, (ms, _) in self._guards.items() if dead is None or set(ms) & dead]
            for name in hit:
                members, refs = self._guards.pop(name)
                # The dead's ranks in that generation: the pair to a silent one must be closed.
                ranks = [members.index(m) for m in dead or () if m in members]
                groups = [ref() for ref in refs]
                sever((g for g in groups if g is not None), dead=ranks)
                del groups

    def close(self) -> None:
        """Stop and join the heartbeat thread (it beats ``exit``) and forget the guards.

        Example::

            live.close()
        """
        if self.watch is not None:
            self.watch.close()
        with self._lock:
            self._guards.clear()

    def start_watch(self, freeze_s: float, store: dist.Store | None = None) -> None:
        """Start this member's heartbeat thread (``freeze_s`` > 0: declare a member whose beat
        stood still that long dead and sever the groups that span it). ``store``: the thread's
        own connection to the supervisor's store (default: this world's). A TCPStore client
        serialises its calls, so a beat sharing the main thread's connection waits behind any
        blocking wait of it (a gloo rendezvous waiting for a slow peer) and the others would
        take this member for frozen."""
        if self.watch is None:
            self.watch = LiveWatch.start(store if store is not None else self.store, member=self.member,
                                         watched=self.watched, freeze_s=freeze_s, on_dead=self.sever_guarded)

    @classmethod
    def join(
        cls, address: str | None = None, *, member: int | None = None, world: int | None = None,
        timeout_s: float = 60.0, backend: str = "gloo", joining: bool | None = None,
        freeze_s: float = 30.0, key: str | None = None,
    ) -> LiveWorld:
        """Connect to the supervisor's store; join generation 0's default group, or (a joiner)
        register to be admitted at the next step boundary. ``key``: the store's secret (default
        ``$VARUNA_LIVE_STORE_KEY``). A heartbeat thread starts
        (Note [Live watch]): a member silent for ``freeze_s`` (0: never) is declared dead.

        Example::

            live = LiveWorld.join("10.0.0.4:29400", member=3, world=4)
        """
        env = ProcessEnv.from_env()  # Note [One parser] in varuna/core/env.py
        address = address or env.settings.live_store or ""
        key = key or env.settings.live_store_key
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise ValueError(f"live morph needs the rendezvous store as host:port (got {address!r}); "
                             f"set ${LIVE_STORE_ENV}")
        if not key:
            raise ValueError(f"live morph needs the store's secret in ${LIVE_STORE_KEY_ENV} (varuna-launch "
                             "--live-morph and the manager set it for their workers)")
        # A morph collects the old groups' handles (engine.close); with the imports frozen out of
        # the collector that walk covers only what the run made since (docs/live_morph.md,
        # Benchmark: the full collections were most of the tear down).
        gc.freeze()
        member = env.rank if member is None else member
        joining = env.settings.live_join if joining is None else joining
        # Every generation's gloo group binds to the interface towards the job's rendezvous host.
        choose_gloo_interface(env.master_addr or host, env)
        # Two connections: the heartbeat thread must not wait behind the main thread's blocking
        # waits (start_watch). Both prove the run's key (Note [Store authentication]).
        store = AuthStore(host, int(port), key=key, timeout=timedelta(seconds=timeout_s))
        beats = AuthStore(host, int(port), key=key, timeout=timedelta(seconds=timeout_s))
        if joining:
            live = cls(store=store, member=member, members=[], timeout_s=timeout_s, joining=True)
            live.start_watch(freeze_s, beats)  # beating before it registers: nobody takes it for frozen
            i = store.add(f"{ROOT}joins", 1)
            store.set(f"{ROOT}join/{i}", str(member))
            return live
        world = env.world_size if world is None else world
        live = cls(store=store, member=member, members=list(range(world)), timeout_s=timeout_s,
                   expected=list(range(world)))
        live.start_watch(freeze_s, beats)
        _init_group(live, backend)
        return live


def declare_dead(store: dist.Store, member: int) -> None:
    """The supervisor's word that ``member``'s process is gone (it saw the exit, any code):
    members stop waiting for it at once instead of after the join window.

    Example::

        declare_dead(store, member=3)    # after waitpid saw worker 3 exit
    """
    store.set(f"{ROOT}dead/{member}", "1")


def request_layout(store: dist.Store, P: int, D: int) -> None:
    """The manager's P×D for the next generations (e.g. the simulator's best plan for the VMs
    it now has); used when P×D members are there and it fits the model, else the built-in rule.

    Example::

        request_layout(store, 2, 2)
    """
    if P < 1 or D < 1:
        raise ValueError(f"request_layout needs P >= 1 and D >= 1 (got {P}x{D})")
    store.set(f"{ROOT}plan", f"{P} {D}")


def end_job(store: dist.Store) -> None:
    """The job is over: spares and joiners still waiting leave (exit 0).

    Example::

        end_job(live.store)
    """
    store.set(f"{ROOT}done", "1")


def recover(engine: Engine, model: nn.Module | Callable[[], nn.Module], live: LiveWorld, *,
            join_window_s: float = 30.0, backend: str = "gloo") -> Engine | None:
    """After a failed step: regroup and return this worker's engine for the new layout (None: a
    spare now). ``model``: a fresh copy of the model, or a function making one (needed when a
    member is lost during the regroup itself and it is tried again). Raises :class:`LiveMorphFailed` when the
    run must restart from a checkpoint. ``live.last_morph`` tells what happened.

    Example::

        engine = recover(engine, build_model(), live)
        step = engine.step_count + 1
    """
    spent: list[nn.Module] = []

    def build(P: int, D: int) -> Engine:
        if isinstance(model, nn.Module) and spent:
            raise LiveMorphFailed("a second regroup attempt needs a fresh model: pass recover() a model "
                                  "factory (a function returning a new model)")
        fresh = model if isinstance(model, nn.Module) else model()
        spent.append(fresh)
        cfg = dataclasses.replace(engine.config, pipeline_depth=P, data_parallel=D, resume=False)
        return Engine(fresh, cfg, **engine.rebuild_args)

    return morph(live, engine, build, join_window_s=join_window_s, backend=backend, failed=True)


def morph(live: LiveWorld, held: Engine | None, build: Callable[[int, int], Engine], *,
          leaving: bool = False, join_window_s: float = 30.0, wait_s: float | None = None,
          backend: str = "gloo", on_phase: Phase | None = None, failed: bool = False) -> Engine | None:
    """Go to the next generation: tear ``held`` down (its state stays in memory), arrive, agree on
    the members, plan P'×D', join the new group, build the new engine with ``build(P, D)`` and
    receive the missing state from holders. ``held`` None: a spare or joiner (``wait_s`` bounds
    its wait for a generation; None = ``live.timeout_s``). ``leaving``: hand over and go (notice).
    Retries into the next generation when members are lost during the regroup itself. ``failed``:
    a step failed (a peer was lost): sever the old groups first (Note [Live watch]).

    Example::

        engine = morph(live, engine, lambda P, D: Engine(build_model(), cfg(P, D), **args))
    """
    t0 = time.monotonic()
    old = (held.layout.P, held.layout.D) if held is not None else None
    if held is not None:
        sharded = bool(held.config.optimizer_state.shard) and held.layout.D > 1
        if sharded and not failed:
            held.gather_optimizer_state()  # while its groups are up: the state leaves by name, whole
        live.collect_due = _tear_down(live, held, failed)
        if sharded and failed:
            raise LiveMorphFailed(
                "the optimizer state was sharded over the replicas (optimizer_state.shard) and a step "
                "failed: the shards cannot be gathered without the lost peer's; restart from the newest "
                "checkpoint"
            )
    record = _record(held, leaving)
    failures: list[str] = []
    for attempt in range(1, _MAX_ATTEMPTS + 1):
        if live.declared_dead():  # frozen while the others went on: never arrive with stale state
            raise DeclaredDead(f"member {live.member} was declared dead while it could not run; the run "
                               "went on without it")
        if live.joining and held is None:
            admitted = _await_admission(live, wait_s or live.timeout_s)
        else:
            gen = live.generation + 1
            live.store.set(f"{ROOT}gen{gen}/member/{live.member}", json.dumps(record))
            if on_phase:
                on_phase("arrived", gen)
            window = join_window_s if held is not None else None  # a stateless member never closes early
            admitted = _close(live, gen, window, wait_s or live.timeout_s if held is None else live.timeout_s)
        if admitted is None:  # the job ended while this worker waited
            live.finished = True
            return None
        gen, closed = admitted
        try:
            new = _form(live, gen, closed, held, build, leaving, backend, on_phase)
        except LiveMorphFailed:
            raise
        except ValueError as e:  # the new layout cannot be built (a configuration error): retrying won't help
            raise LiveMorphFailed(f"generation {gen}: {' '.join(str(e).split())[:300]}") from None
        except RuntimeError as e:  # a member lost during the regroup: next generation
            failures.append(f"generation {gen}: {' '.join(str(e).split())[:160]}")
            live.sever_guarded()  # peers blocked on this member in the failed generation go at once
            _drop_default_group(live)
            live.collect_due = False  # just collected
            live.joining = False  # a joiner admitted once is a member without state from now on
            record = _record(held, leaving)
            continue
        _collect_if_due(live)  # not overlapped with a wait this time: now
        if live.last_morph is not None and live.last_morph.generation == gen:
            live.last_morph = dataclasses.replace(live.last_morph, old=old, seconds=time.monotonic() - t0,
                                                  attempts=attempt)
            if new is not None and new.layout.rank == 0:
                _say(live.last_morph)
        return new
    raise LiveMorphFailed(f"{_MAX_ATTEMPTS} regroups in a row lost members ({'; '.join(failures)}); "
                          "restart from the newest checkpoint")


# ----------------------------------------------------------------------------------- internals


def _say(m: MorphReport) -> None:
    old = f"{m.old[0]}x{m.old[1]}" if m.old else "-"
    print(f"varuna: live morph to generation {m.generation}: lost {m.lost}, joined {m.joined}, "
          f"left {m.left}, {old} -> {m.new[0]}x{m.new[1]}, resuming after step {m.resumed_after} "
          f"({m.seconds:.1f}s, {m.received_bytes} bytes from peers, no restart, no checkpoint read)",
          flush=True)


def _record(held: Engine | None, leaving: bool) -> dict:
    """This member's arrival record: what state it holds (names, step, layout it came from)."""
    if held is None:
        return {"holds": False, "leaving": leaving}
    L = held.layout
    sd = held.state_dict()  # the state beyond tensors travels in the record (Note [Whole state])
    stage = sd["optimizer"].get("stage_state")
    return {"holds": True, "leaving": leaving, "step": held.committed_step,
            "sgen": getattr(held, "live_generation", 0),
            "rank": L.rank, "P": L.P, "D": L.D, "names": sorted(_stage_tensors(held)),
            "scale": held.scaler.state_dict(), "max_stages": held.profile.num_segments,
            "max_replicas": sum(len(p) for p in held.micro_plan),
            "extra": to_json(sd["extra"]["global"]), "segments": _segments(held),
            "stage_state": to_json(stage) if stage else None}


def _init_group(live: LiveWorld, backend: str) -> None:
    """The generation's default group, under its own store prefix (old keys never collide)."""
    prefix = dist.PrefixStore(f"{ROOT}gen{live.generation}/pg/", live.store)
    dist.init_process_group(backend, store=prefix, rank=live.rank, world_size=len(live.members),
                            timeout=timedelta(seconds=live.timeout_s))
    live.guard("world", live.members, [dist.distributed_c10d._get_default_group()])


def _tear_down(live: LiveWorld, engine: Engine, failed: bool) -> bool:
    """Stop the engine's threads and drop every group, the default one too. After a failed step
    every group is severed first (Note [Live watch]): this process's threads blocked on a peer
    fail at once, and so does every peer still waiting on this one, whatever handle may linger
    (gloo's abort() does not do it, torch 2.13: docs/live_morph.md). The parameters and
    optimizer stay. Returns whether a garbage collection is still due (a subgroup handle outlived
    the tear down)."""
    if failed:
        live.sever_guarded()
    live.unguard("engine")
    live.unguard("world")  # before the groups go: the watch never severs a later generation's
    # The live world made the default group and wants it gone too: the engine destroys it with
    # its subgroups. The collection for handles caught in reference cycles (each full one costs
    # ~0.1-0.2 s here: docs/live_morph.md, Findings) waits for the first idle moment of the
    # regroup (_collect_if_due).
    handles = [g for g in engine._groups.created if isinstance(g, dist.ProcessGroup)]
    engine._owns_pg = dist.is_initialized()
    engine.close(collect=False)  # watch, links, every group (every handle released)
    _drop_default_group(live, collect=False)
    # Only a handle with another holder left can need the collection (a cycle, a frame). The
    # default group is not checked: its handle keeps references that no collection frees
    # (measured, torch 2.13), so checking it would make every morph pay for nothing.
    return _held_elsewhere(handles)


def _held_elsewhere(objs: list) -> bool:
    """Whether any of ``objs`` has a reference besides ``objs`` itself (calibrated on an object
    held the same way, so the interpreter's own counting does not matter)."""
    base = max(_refcounts([object()]))
    return any(n > base for n in _refcounts(objs))


def _refcounts(objs: list) -> list[int]:
    return [sys.getrefcount(o) for o in objs]


def _collect_if_due(live: LiveWorld) -> None:
    """The torn-down engine's collection, run once where this member would wait anyway (for the
    membership, for transfers in flight) or at the end of the morph."""
    if live.collect_due:
        live.collect_due = False
        gc.collect()


def _drop_default_group(live: LiveWorld, *, collect: bool = True) -> None:
    """Destroy the default group if there is one; ``collect``: also when there was none (after a
    failed regroup, handles of what it built may sit in reference cycles)."""
    live.unguard("world")  # before the group goes: the watch never severs a later generation's
    if dist.is_initialized():
        dist.destroy_process_group()
        collect = True
    if collect:
        gc.collect()


def _dead(store: dist.Store, members: list[int]) -> set[int]:
    return {m for m in members if store.check([f"{ROOT}dead/{m}"])}


def _close(live: LiveWorld, gen: int, window_s: float | None,
           wait_s: float) -> tuple[int, dict] | None:
    """Wait until generation ``gen``'s membership is closed: every expected member arrived or is
    dead, or (``window_s``) the window ran out; the first to see it writes the list (compare-and-
    set: one list for everyone). None: the job ended first (only while waiting without state)."""
    store, pre = live.store, f"{ROOT}gen{gen}/"
    closed_key, t0 = f"{pre}closed", time.monotonic()
    while not store.check([closed_key]):
        if window_s is None and store.check([f"{ROOT}done"]):
            return None
        dead = _dead(store, live.expected)
        arrived = [m for m in live.expected if m not in dead and store.check([f"{pre}member/{m}"])]
        pending = set(live.expected) - set(arrived) - dead
        waited = time.monotonic() - t0
        # The window is for members nobody hears from; one whose heartbeat is fresh is alive and
        # still leaving the old generation (its tear-down), so it is waited for (up to wait_s).
        # A frozen one is declared dead by a watch within freeze_s (Note [Live watch]).
        late = window_s is not None and waited > window_s and not any(live.alive(m) for m in pending)
        if not pending or late:
            store.compare_set(closed_key, "", json.dumps({"arrived": arrived, **_snapshot(live)}))
            store.set(f"{ROOT}generation", str(gen))
            break
        if waited > wait_s:
            raise (WaitExpired if window_s is None else LiveMorphFailed)(
                f"member {live.member} waited {wait_s:.0f}s for generation {gen} to form")
        if live.collect_due:
            _collect_if_due(live)  # instead of idling: the members not there yet are the critical path
            continue
        time.sleep(_POLL_S)  # a poll of the store, bounded above
    closed = json.loads(store.get(closed_key))
    if live.member not in closed["arrived"]:
        raise LiveMorphFailed(f"member {live.member} arrived after generation {gen}'s membership closed "
                              f"({closed['arrived']}); restart from the newest checkpoint")
    return gen, closed


def _wait_for(live: LiveWorld, keys: list[str], writers: list[int]) -> None:
    """Wait (bounded) for ``keys``, which ``writers`` set; fail at once when one of them is
    declared dead (a member lost during the regroup: the caller goes to the next generation)."""
    store, t0 = live.store, time.monotonic()
    while not store.check(keys):
        dead = _dead(store, writers)
        if dead:
            raise RuntimeError(f"members {sorted(dead)} died during the regroup")
        if time.monotonic() - t0 > live.timeout_s:
            raise RuntimeError(f"waited {live.timeout_s:.0f}s for {keys[0]} (and {len(keys) - 1} more keys)")
        time.sleep(_POLL_S)  # a poll of the store, bounded above


def _snapshot(live: LiveWorld) -> dict:
    """The joiners registered so far and the manager's layout request, frozen for a generation."""
    store = live.store
    count = store.add(f"{ROOT}joins", 0)
    keys = [f"{ROOT}join/{i}" for i in range(live.joins_consumed + 1, count + 1)]
    if keys:  # a joiner sets its key right after taking its number
        try:
            store.wait(keys, timedelta(seconds=live.timeout_s))
        except RuntimeError:  # a joiner died between taking its number and registering: skip it
            keys = [k for k in keys if store.check([k])]
    joiners = [int(v) for v in store.multi_get(keys)] if keys else []
    dead = _dead(store, joiners)
    plan = store.get(f"{ROOT}plan").decode().split() if store.check([f"{ROOT}plan"]) else None
    return {"joiners": [j for j in joiners if j not in dead], "joins_consumed": count,
            "plan": [int(x) for x in plan] if plan else None}


def _await_admission(live: LiveWorld, wait_s: float) -> tuple[int, dict] | None:
    """A joiner waits for the first generation that admits it (None: the job ended first)."""
    store, t0 = live.store, time.monotonic()
    gen = int(store.get(f"{ROOT}generation")) + 1 if store.check([f"{ROOT}generation"]) else 1
    while time.monotonic() - t0 <= wait_s:
        key = f"{ROOT}gen{gen}/closed"
        if store.check([key]):
            closed = json.loads(store.get(key))
            if live.member in closed["joiners"]:
                return gen, closed
            gen += 1
            continue
        if store.check([f"{ROOT}done"]):
            return None
        time.sleep(_POLL_S)  # a poll of the store, bounded above
    raise WaitExpired(f"joiner {live.member} was not admitted within {wait_s:.0f}s")


def _form(live: LiveWorld, gen: int, closed: dict, held: Engine | None, build: Callable[[int, int], Engine],
          leaving: bool, backend: str, on_phase: Phase | None) -> Engine | None:
    """Every participant of ``gen`` computes the same plan from the same records, then works,
    hands over and leaves, or waits as a spare."""
    store, pre = live.store, f"{ROOT}gen{gen}/"
    arrived = closed["arrived"]
    recs = dict(zip(arrived, (json.loads(v) for v in store.multi_get([f"{pre}member/{m}" for m in arrived]))))
    step, holders = _newest_holders(recs, [m for m in arrived if recs[m]["holds"]])
    _check_stages(recs, holders)
    staying = sorted((m for m in holders if not recs[m]["leaving"]), key=lambda m: (recs[m]["rank"], m))
    newcomers = sorted(m for m in arrived if not recs[m]["holds"] and not recs[m]["leaving"])
    newcomers += sorted(j for j in closed["joiners"] if j not in newcomers)
    leavers = sorted(m for m in arrived if recs[m]["leaving"])
    ref = recs[holders[0]]
    hint = tuple(closed["plan"]) if closed["plan"] else None
    P, D, n = plan_generation(old_P=ref["P"], holders=len(staying), newcomers=len(newcomers),
                              max_stages=ref["max_stages"], max_replicas=ref["max_replicas"], hint=hint)
    order = staying + newcomers
    lost = [m for m in live.members + live.spares if m not in arrived]  # leavers are not lost
    live.generation, live.members, live.spares = gen, order[:n], order[n:]
    live.expected = order + leavers
    live.joins_consumed = max(live.joins_consumed, closed["joins_consumed"])
    live.joining = False
    if live.member in live.spares:
        return None
    xfer = live.members + leavers
    if held is not None and live.member not in holders:
        held = None  # its state is a step behind: it serves nothing and keeps nothing of it
    if live.member in leavers:
        _hand_over(live, gen, xfer, recs, held, None, on_phase)
        live.close()  # its watch stops first: it would take the word below for a freeze verdict
        declare_dead(store, live.member)  # gone: nobody waits for it in a later generation
        return None
    _init_group(live, backend)
    new = build(P, D)
    try:
        new._owns_pg = True  # the live world made this group; the engine destroys it on close
        new.live_generation = gen
        received = _hand_over(live, gen, xfer, recs, held, new, on_phase)
        state = received.pop("state")
        first = min(_segments(new))  # the optimizer's state outside state[param]: its old stage's
        stage = next((r["stage_state"] for r in recs.values() if r.get("holds") and r.get("stage_state")
                      and first in r.get("segments", [])), None)
        if stage is not None:
            state["optimizer"]["stage_state"] = from_json(stage)
        # copy=False: the optimizer adopts the received tensors and the held engine's (dropped now)
        new.load_state_dict({"step": step, "loss_scale": ref["scale"], **state,
                             "extra": {"global": from_json(ref.get("extra", {}))}}, copy=False)
    except BaseException:
        new.close()
        new = None  # no handle may keep the groups' sockets open (peers must fail, not hang)
        raise
    live.last_morph = MorphReport(generation=gen, lost=lost, old=None, new=(P, D), resumed_after=step,
                                  received_bytes=received["bytes"], seconds=0.0,
                                  joined=sorted(j for j in closed["joiners"] if j in live.members),
                                  left=leavers)
    return new


def _newest_holders(recs: dict, holders: list[int]) -> tuple[int, list[int]]:
    """The step the next generation resumes after and the members whose state it takes.

    Note [Mixed steps]: a peer lost inside a step's last collective lets some members commit the
    step and not others (CI: rank 3 froze inside the end-of-step agreement, a world all-reduce
    that completed on ranks 0 and 1, which committed step 7, and not on rank 2, left at 6). A committed
    step is whole (no member commits before every collective of the step completed, with every
    replica's gradients in it), so the newest step's holders are a sound model provided they hold
    every name the others hold. The holders a step behind then hold nothing (``recs`` is changed
    to say so): they receive their new stage from the newest ones, like newcomers. Where the
    newest holders lack a name, no single step is whole: restart from a checkpoint.
    """
    if not holders:
        raise LiveMorphFailed("no member holds any state (every holder is gone); restart from the newest "
                              "checkpoint")
    steps = sorted({recs[m]["step"] for m in holders})
    newest = [m for m in holders if recs[m]["step"] == steps[-1]]
    if len(steps) > 1:
        have = {n for m in newest for n in recs[m]["names"]}
        missing = sorted({n for m in holders for n in recs[m]["names"]} - have)
        if missing:
            raise LiveMorphFailed(f"members committed different steps {steps} and those at step {steps[-1]} "
                                  f"lack {len(missing)} tensor(s) (e.g. {missing[0]}); a mixed-step model "
                                  "cannot go on, restart from the newest checkpoint")
        for m in holders:
            if m not in newest:
                recs[m] = {**recs[m], "holds": False}
    return steps[-1], newest


def _check_stages(recs: dict, holders: list[int]) -> None:
    """With one state layout among the holders, every stage of it needs a holder (the names check
    in :func:`transfer_plan` covers mixed layouts, after a regroup that failed half way)."""
    layouts = {(recs[m]["sgen"], recs[m]["P"], recs[m]["D"]) for m in holders}
    if len(layouts) != 1:
        return
    (_, P, D), = layouts
    held = {stage_and_replica(recs[m]["rank"], P)[0] for m in holders}
    for k in range(P):
        if k not in held:
            raise LiveMorphFailed(f"stage {k} has no live replica (old ranks {[d * P + k for d in range(D)]} "
                                  "are gone); the run must restart from its newest checkpoint")


def _stage_tensors(engine: Engine) -> dict[str, torch.Tensor]:
    """The stage's parameters and persistent buffers by name (what a transfer moves)."""
    return {**engine.extras.buffers.named(), **engine.stage_params}


def _segments(engine: Engine) -> list[int]:
    P = engine.layout.P
    return [s for a, b in engine.stage_ranges[engine.stage :: P] for s in range(a, b + 1)]


def _stage_state(engine: Engine, names: list[str]) -> dict:
    trainable = dict(engine.named_parameters())
    buffers = engine.extras.buffers.named()
    return {"params": {n: engine.stage_params[n].detach() for n in names if n not in buffers},
            "buffers": {n: buffers[n] for n in names if n in buffers},
            "optimizer": engine.optimizer_state(only=[n for n in names if n in trainable])}


def _hand_over(live: LiveWorld, gen: int, xfer: list[int], recs: dict, held_engine: Engine | None,
               new: Engine | None, on_phase: Phase | None) -> dict:
    """Send and receive stage state among ``xfer`` (working members in rank order, then leavers)
    over a transfer group of their own: only names the receiver lacks, from a holder
    (:func:`transfer_plan`; a leaver serves only names no staying member holds). Returns, for a
    working member, its new stage's state and the bytes received."""
    store, pre, me = live.store, f"{ROOT}gen{gen}/", xfer.index(live.member)
    working = len(live.members)
    if new is not None:
        store.set(f"{pre}needs/{live.member}", json.dumps(sorted(_stage_tensors(new))))
    keys = [f"{pre}needs/{m}" for m in xfer[:working]]
    _wait_for(live, keys, xfer[:working])
    needs = [json.loads(v) for v in store.multi_get(keys)] + [[] for _ in xfer[working:]]
    held = [recs[m]["names"] if recs.get(m, {}).get("holds") else [] for m in xfer]
    kept = {n for h in held[:working] for n in h}
    held = held[:working] + [[n for n in h if n not in kept] for h in held[working:]]
    plan = transfer_plan(held, needs)  # ValueError (a name nobody holds) -> the caller's restart path
    sends = {dst: names for (src, dst), names in plan.items() if src == me}
    recvs = sorted(src for (src, dst) in plan if dst == me)
    parts, nbytes = [], 0
    if plan:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{pre}xpg/", store), me, len(xfer),
                                   timedelta(seconds=live.timeout_s))
        live.guard("xfer", xfer, [pg])  # a member frozen in the transfer: severed, not waited for
        try:
            if on_phase:
                on_phase("transfer", gen)
            parts, nbytes = _exchange(live, pre, pg, xfer, me, sends, recvs, held_engine, new)
        except BaseException:
            sever([pg])  # the others still waiting on this member fail now (Note [Live watch])
            live.unguard("xfer")
            pg = None  # dropping the handle closes its sockets: peers fail instead of hanging
            gc.collect()  # the failure's frames may sit in cycles
            raise
        live.unguard("xfer")
        pg = None  # no cycle holds it on success: freed (sockets closed) right here
    elif on_phase:
        on_phase("transfer", gen)
    if new is None:
        return {}
    held_names = _stage_tensors(held_engine) if held_engine is not None else {}
    mine = [n for n in _stage_tensors(new) if n in held_names]
    parts = ([_stage_state(held_engine, mine)] if mine else []) + parts
    params = {n: t for part in parts for n, t in part["params"].items()}
    buffers = {n: t for part in parts for n, t in part.get("buffers", {}).items()}
    return {"state": {"params": params, "buffers": buffers,
                      "optimizer": merge_optimizer_states(p["optimizer"] for p in parts)},
            "bytes": nbytes}


def _exchange(live: LiveWorld, pre: str, pg: dist.ProcessGroup, xfer: list[int], me: int,
              sends: dict[int, list[str]], recvs: list[int], engine: Engine | None,
              new: Engine | None) -> tuple[list[dict], int]:
    """Post every send and receive at once (no ordering deadlock), wait for each (bounded), then a
    barrier: a leaver exits only once every receiver has its state. Metadata goes via the store.
    Tensors go as they are: sent from the held engine's own tensors (the same ones to several
    receivers), received straight into the new engine's parameters (live_transfer.py)."""
    timeout = timedelta(seconds=live.timeout_s)
    works, keep = [], []  # every tensor stays referenced until its message completed
    for dst, names in sorted(sends.items()):
        meta, tensors = describe_state(_stage_state(engine, names))
        live.store.set(f"{pre}xfer/{xfer[me]}-{xfer[dst]}", meta)
        keep += tensors
        works += [pg.send([t], dst, tag) for tag, t in enumerate(tensors)]
    into = _stage_tensors(new) if new is not None else {}
    parts, nbytes = [], 0
    for src in recvs:
        key = f"{pre}xfer/{xfer[src]}-{live.member}"
        _wait_for(live, [key], [xfer[src]])
        state, targets = receive_targets(live.store.get(key).decode(), into)
        parts.append(state)
        keep += targets
        nbytes += sum(t.numel() * t.element_size() for t in targets)
        works += [pg.recv([t], src, tag) for tag, t in enumerate(targets)]
    _collect_if_due(live)  # while gloo's threads move the bytes
    for w in works:
        w.wait(timeout)
    pg.allreduce([torch.zeros(1)]).wait(timeout)
    return parts, nbytes
