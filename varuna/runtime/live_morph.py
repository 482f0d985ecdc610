"""Morph without a restart: survivors of a lost peer re-form their groups and keep their state.

The protocol is in docs/live_morph.md. In short: every worker joins generation 0 over a rendezvous
store hosted outside the workers (the launcher's, the test's; ``$VARUNA_LIVE_STORE``), so the
store outlives any worker. When a step fails because a peer died, each survivor tears its groups
down (dropping every handle, so its sockets close and survivors still waiting on it fail too),
announces itself for generation g+1 with the last step it committed, and waits -- bounded -- until
every member of generation g has arrived or been declared dead by its supervisor
(:func:`declare_dead`). All survivors then compute the same new layout from the same member list
(:func:`varuna.core.live_layout.plan_survivor_layout`), join a new default process group under a
fresh ``PrefixStore`` prefix, build the engine for their new stage on a fresh copy of the model,
and receive the parameters and optimizer state they lack from survivors that hold them
(:func:`varuna.core.live_layout.transfer_plan`), never from a checkpoint. Training goes on from the
last committed step; the step in flight is redone. When that is impossible (a stage without a
live replica, survivors at different steps, a wait that ran out), :class:`LiveMorphFailed` says
why and the caller exits with ``PEER_LOST_EXIT_CODE`` -- the restart path.

Example (the worker's loop)::

    live = LiveWorld.join()                      # $VARUNA_LIVE_STORE, $RANK, $WORLD_SIZE
    engine = varuna.Engine(build_model(), config, example_batch=b, optimizer=opt)
    step = 1
    while step <= steps:
        try:
            engine.train_step(batch_for(step))
        except RuntimeError:                     # a peer died in this step
            engine = recover(engine, build_model(), live)
            step = engine.step_count + 1         # the step in flight is redone
            continue
        step += 1
"""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from varuna.core.live_layout import NoLiveReplica, plan_survivor_layout, transfer_plan
from varuna.runtime.checkpoint import load_engine_state_dict
from varuna.runtime.engine import Engine
from varuna.runtime.optimizer_state import merge_optimizer_states, optimizer_state_by_name

__all__ = ["LIVE_STORE_ENV", "LiveMorphFailed", "LiveWorld", "MorphReport", "declare_dead", "recover"]

#: ``host:port`` of the rendezvous store the workers' supervisor hosts (outlives every worker).
LIVE_STORE_ENV = "VARUNA_LIVE_STORE"
_ROOT = "varuna/live/"
_POLL_S = 0.02  # how often a survivor re-reads the store while members are still arriving


class LiveMorphFailed(RuntimeError):
    """The survivors cannot go on without a restart; the message says why (exit, restart path)."""


@dataclass(frozen=True)
class MorphReport:
    """What one live morph did, as seen by this worker."""

    generation: int
    lost: list[int]
    old: tuple[int, int]
    new: tuple[int, int]
    resumed_after: int
    received_bytes: int
    seconds: float


@dataclass
class LiveWorld:
    """This worker's place in the live run: the store, its stable member id, the generation,
    and the working members of the generation in rank order (``members[rank]``)."""

    store: dist.Store
    member: int
    members: list[int]
    generation: int = 0
    timeout_s: float = 60.0
    """Bound of each wait of a regroup (arrivals, state transfer)."""
    last_morph: MorphReport | None = None
    """What the latest :func:`recover` did, on this worker."""

    @property
    def rank(self) -> int:
        return self.members.index(self.member)

    @classmethod
    def join(
        cls, address: str | None = None, *, member: int | None = None, world: int | None = None,
        timeout_s: float = 60.0, backend: str = "gloo",
    ) -> LiveWorld:
        """Connect to the supervisor's store and join generation 0's default group.

        Example::

            live = LiveWorld.join("10.0.0.4:29400", member=3, world=4)
        """
        address = address or os.environ.get(LIVE_STORE_ENV, "")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"live morph needs the rendezvous store as host:port (got {address!r}); "
                             f"set ${LIVE_STORE_ENV}")
        member = int(os.environ["RANK"]) if member is None else member
        world = int(os.environ["WORLD_SIZE"]) if world is None else world
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        live = cls(store=store, member=member, members=list(range(world)), timeout_s=timeout_s)
        _init_group(live, backend)
        return live


def declare_dead(store: dist.Store, member: int) -> None:
    """The supervisor's word that ``member``'s process is gone (it saw the exit): survivors stop
    waiting for it at once instead of after the join window.

    Example::

        declare_dead(store, member=3)    # after waitpid saw worker 3 killed
    """
    store.set(f"{_ROOT}dead/{member}", "1")


def recover(engine: Engine, model: nn.Module, live: LiveWorld, *, join_window_s: float = 30.0,
            backend: str = "gloo") -> Engine | None:
    """After a failed step: regroup the survivors and return this worker's engine for the new
    layout (None: this worker is a spare of the new generation). ``model``: a fresh copy of the
    model (the old engine's was materialised for its stage). Raises :class:`LiveMorphFailed`
    when the run must restart from a checkpoint. ``live.last_morph`` tells what happened.

    Example::

        engine = recover(engine, build_model(), live)
        step = engine.step_count + 1
    """
    t0 = time.monotonic()
    old_layout, committed = engine.layout, engine.committed_step
    _tear_down(engine)
    gen = live.generation + 1
    records = _rendezvous(live, gen, committed, old_layout.rank, join_window_s)
    steps = {s for s, _ in records.values()}
    if len(steps) > 1:
        raise LiveMorphFailed(f"survivors committed different steps {sorted(steps)}; a mixed-step model "
                              "cannot go on, restart from the newest checkpoint")
    by_old_rank = {r: m for m, (_, r) in records.items()}
    try:
        plan = plan_survivor_layout(
            old_P=old_layout.P, old_D=old_layout.D, survivors=sorted(by_old_rank),
            max_stages=engine.profile.num_segments, max_replicas=sum(len(p) for p in engine.micro_plan),
        )
    except NoLiveReplica as e:
        raise LiveMorphFailed(str(e)) from e
    lost = [m for m in live.members if m not in records]
    live.generation = gen
    live.members = [by_old_rank[r] for r in sorted(plan.new_rank, key=plan.new_rank.__getitem__)]
    if live.member not in live.members:
        return None
    _init_group(live, backend)
    config = dataclasses.replace(engine.config, pipeline_depth=plan.P, data_parallel=plan.D, resume=False)
    new = Engine(model, config, **engine.rebuild_args)
    new._owns_pg = True  # the live world made this group; the engine destroys it on close
    received = _transfer_state(engine, new, live, committed)
    live.last_morph = MorphReport(generation=gen, lost=lost, old=(old_layout.P, old_layout.D),
                                 new=(plan.P, plan.D), resumed_after=committed, received_bytes=received,
                                 seconds=time.monotonic() - t0)
    if new.layout.rank == 0:
        print(f"varuna: live morph to generation {gen}: members {lost} lost, {old_layout.P}x{old_layout.D}"
              f" -> {plan.P}x{plan.D}, resuming after step {committed} "
              f"({live.last_morph.seconds:.1f}s, no restart, no checkpoint read)", flush=True)
    return new


# ----------------------------------------------------------------------------------- internals


def _init_group(live: LiveWorld, backend: str) -> None:
    """The generation's default group, under its own store prefix (old keys never collide)."""
    prefix = dist.PrefixStore(f"{_ROOT}gen{live.generation}/pg/", live.store)
    dist.init_process_group(backend, store=prefix, rank=live.rank, world_size=len(live.members),
                            timeout=timedelta(seconds=live.timeout_s))


def _tear_down(engine: Engine) -> None:
    """Stop the engine's threads and drop every group, the default one too. Dropping the last
    handle closes the group's sockets, which fails any survivor still waiting on this one (gloo's
    abort() does not, torch 2.13: docs/live_morph.md). The parameters and optimizer stay."""
    engine.close()  # watch, links, subgroups (every handle released, collected)
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _rendezvous(live: LiveWorld, gen: int, committed: int, old_rank: int,
                window_s: float) -> dict[int, tuple[int, int]]:
    """Announce this survivor; return every arrived member's (committed step, old rank) once the
    membership is closed: all of generation g arrived or declared dead, or the window ran out.
    The first survivor to see that closes it (compare-and-set: one list for everyone)."""
    store, pre = live.store, f"{_ROOT}gen{gen}/"
    store.set(f"{pre}member/{live.member}", f"{committed} {old_rank}")
    closed = f"{pre}closed"
    t0 = time.monotonic()
    while not store.check([closed]):
        arrived = [m for m in live.members if store.check([f"{pre}member/{m}"])]
        dead = [m for m in live.members if store.check([f"{_ROOT}dead/{m}"])]
        if set(arrived) | set(dead) >= set(live.members) or time.monotonic() - t0 > window_s:
            store.compare_set(closed, "", json.dumps(arrived))
            break
        time.sleep(_POLL_S)  # a poll of the store, bounded by the window above
    members = json.loads(store.get(closed))
    if live.member not in members:
        raise LiveMorphFailed(f"member {live.member} arrived after generation {gen}'s membership closed "
                              f"({members}); restart from the newest checkpoint")
    values = store.multi_get([f"{pre}member/{m}" for m in members])
    out = {}
    for m, v in zip(members, values):
        step, rank = v.decode().split()
        out[m] = (int(step), int(rank))
    return out


def _publish_names(live: LiveWorld, key: str, names: list[str]) -> list[list[str]]:
    """Publish this rank's ``names`` under ``key`` and read every rank's (bounded wait)."""
    store, pre = live.store, f"{_ROOT}gen{live.generation}/{key}/"
    store.set(f"{pre}{live.rank}", json.dumps(names))
    keys = [f"{pre}{r}" for r in range(len(live.members))]
    store.wait(keys, timedelta(seconds=live.timeout_s))
    return [json.loads(v) for v in store.multi_get(keys)]


def _stage_state(engine: Engine, names: list[str]) -> dict:
    trainable = dict(engine.named_parameters())
    return {"params": {n: engine.stage_params[n].detach() for n in names},
            "optimizer": optimizer_state_by_name(engine.optimizer, trainable,
                                                 only=[n for n in names if n in trainable])}


def _transfer_state(old: Engine, new: Engine, live: LiveWorld, committed: int) -> int:
    """Give ``new`` its stage's parameters and optimizer state: the ones ``old`` held are copied
    here, the others arrive from the survivors :func:`transfer_plan` names. Returns bytes received."""
    held = _publish_names(live, "held", sorted(old.stage_params))
    needs = _publish_names(live, "needs", sorted(new.stage_params))
    plan = transfer_plan(held, needs)
    me = live.rank
    sends = {dst: names for (src, dst), names in plan.items() if src == me}
    recvs = sorted(src for (src, dst) in plan if dst == me)
    payloads = {dst: _serialise(_stage_state(old, names)) for dst, names in sorted(sends.items())}
    sizes = {src: torch.zeros(1, dtype=torch.int64) for src in recvs}
    _exchange([(dst, torch.tensor([p.numel()], dtype=torch.int64)) for dst, p in payloads.items()],
              sorted(sizes.items()), live.timeout_s)
    bufs = {src: torch.empty(int(sizes[src]), dtype=torch.uint8) for src in recvs}
    _exchange(sorted(payloads.items()), sorted(bufs.items()), live.timeout_s)
    mine = [n for n in new.stage_params if n in old.stage_params]
    parts = [_stage_state(old, mine)] + [torch.load(io.BytesIO(bufs[s].numpy().tobytes()), weights_only=True)
                                         for s in recvs]
    params = {n: t for part in parts for n, t in part["params"].items()}
    state = {"step": committed, "params": params,
             "optimizer": merge_optimizer_states(p["optimizer"] for p in parts),
             "loss_scale": old.scaler.state_dict()}
    load_engine_state_dict(new, state)
    return sum(b.numel() for b in bufs.values())


def _serialise(obj: dict) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
              timeout_s: float) -> None:
    """Post every send and receive at once (no ordering deadlock), then wait, each bounded."""
    ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs]
    if not ops:
        return
    for w in dist.batch_isend_irecv(ops):
        w.wait(timedelta(seconds=timeout_s))
