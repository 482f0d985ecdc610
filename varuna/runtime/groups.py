"""The process groups of one engine and the point-to-point links of its stage.

Every group is created in the same order on every rank (``new_group`` is a collective over the
whole world): per stage its data-parallel group (the D replicas), per pipeline link one group for
activations and one for gradients (Note [One send per message] in comm.py: each direction its own
2-rank group), and per set of stages holding a shared parameter (tied embeddings) one group over
all their replicas.

Example::

    groups = build_groups(layout, stage_ranges, profile.shared_params())
    links = StageLinks.start(layout, groups, device, inbox, timeout_s=300.0)
"""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from varuna.core.partition import stage_of_segment
from varuna.core.schedule import BACKWARD, FORWARD
from varuna.runtime.comm import LinkReceiver, LinkSender
from varuna.runtime.layout import Layout

__all__ = ["ProcessGroups", "StageLinks", "build_groups"]


@dataclass
class ProcessGroups:
    """The groups this rank belongs to (None / empty in a single process)."""

    dp_group: object | None = None
    """This stage's replicas (None when D == 1)."""
    act_groups: dict[tuple[int, int], object] = field(default_factory=dict)
    """(stage k, replica d) -> group of the activation link k -> k+1 of replica d."""
    grad_groups: dict[tuple[int, int], object] = field(default_factory=dict)
    shared: list[tuple[object, list[str]]] = field(default_factory=list)
    """(group, parameter names) for parameters this stage shares with other stages."""
    norm_elsewhere: set[str] = field(default_factory=set)
    """Shared parameters whose gradient another stage counts in the global norm."""
    created: list = field(default_factory=list)
    """Every group created (on every rank), for destruction."""

    def shared_names(self) -> set[str]:
        return {n for _, names in self.shared for n in names}

    def destroy(self) -> None:
        """Destroy the created groups (when the caller owns the default group), then forget them."""
        for g in self.created:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
        self.release()

    def release(self) -> None:
        """Drop every handle (Note [Teardown at exit] in engine.py: a handle still held keeps the
        group's C++ worker threads alive until interpreter finalisation). Every holder of this
        object (gradient sync, determinism) sees the groups gone."""
        self.dp_group = None
        self.act_groups.clear()
        self.grad_groups.clear()
        self.shared = []
        self.created = []


def build_groups(
    layout: Layout,
    stage_ranges: Sequence[tuple[int, int]],
    shared_params: Mapping[str, Sequence[int]],
    *,
    backend: str | None = None,
) -> ProcessGroups:
    """Create every process group in the same order on every rank (a collective).

    ``shared_params``: parameter name -> segments reading it (those read by one segment only are
    ignored). More ranges than P (interleaved, v = len(stage_ranges) / P chunks per process): they
    are the virtual stages, virtual stage j runs on process j % P, and one more link per replica
    joins the last process to the first (activations of chunk c go on to chunk c + 1).
    ``backend``: of every group (``Transport.backend`` in layout.py); None: the default group's."""
    L = layout
    P, D = L.P, L.D
    groups = ProcessGroups()
    chunks = len(stage_ranges) // P
    if L.world == 1:
        return groups
    for k in range(P):
        ranks = [L.rank_of(k, d) for d in range(D)]
        g = dist.new_group(ranks, backend=backend) if D > 1 else None
        groups.created.append(g)
        if k == L.stage:
            groups.dp_group = g
    for d in range(D):
        for k in range(P if chunks > 1 else P - 1):
            pair = [L.rank_of(k, d), L.rank_of((k + 1) % P, d)]
            ga = dist.new_group(pair, backend=backend)
            gg = dist.new_group(pair, backend=backend)
            groups.created += [ga, gg]
            if L.rank in pair:
                groups.act_groups[(k, d)] = ga
                groups.grad_groups[(k, d)] = gg
    seg_stage = stage_of_segment(stage_ranges)
    by_stages: dict[tuple[int, ...], list[str]] = {}
    for name, segs in sorted(shared_params.items()):
        stages = tuple(sorted({seg_stage[s] % P for s in segs}))
        if len(stages) > 1:
            by_stages.setdefault(stages, []).append(name)
    for stages, names in sorted(by_stages.items()):
        ranks = sorted(L.rank_of(k, d) for k in stages for d in range(D))
        g = dist.new_group(ranks, backend=backend)
        groups.created.append(g)
        if L.stage in stages:
            groups.shared.append((g, names))
            if stages[0] != L.stage:
                groups.norm_elsewhere.update(names)
    return groups


@dataclass
class StageLinks:
    """The stage's four link endpoints (None at the pipeline's ends); receivers feed ``inbox``."""

    act_out: LinkSender | None = None
    grad_in: LinkReceiver | None = None
    act_in: LinkReceiver | None = None
    grad_out: LinkSender | None = None

    #: receives per micro-batch and step: (activations, gradients); v chunks each, but one fewer
    #: where the pipeline starts (no activation into chunk 0 of the first process) or ends
    per_mb: tuple[int, int] = (1, 1)

    @classmethod
    def start(
        cls,
        layout: Layout,
        groups: ProcessGroups,
        device: torch.device,
        inbox: queue.Queue,
        timeout_s: float,
        *,
        chunks: int = 1,
        compute_device: torch.device | None = None,
    ) -> StageLinks:
        """Start the sender/receiver endpoints of ``layout``'s stage (threads for the receivers);
        with ``chunks`` > 1 the last process links back to the first (see :func:`build_groups`).
        ``device``: where messages live; ``compute_device`` (default the same): where the stage
        computes (a CUDA stage on gloo links: host messages, Note [Host-staged CUDA messages])."""
        L, t = layout, timeout_s
        cd = compute_device if compute_device is not None else device
        k, d = L.stage, L.replica
        links = cls()
        if chunks > 1:
            links.per_mb = (chunks - (k == 0), chunks - (k == L.P - 1))
        if k < L.P - 1 or (chunks > 1 and L.P > 1):
            nxt = L.rank_of((k + 1) % L.P, d)
            links.act_out = LinkSender(f"act-send-{k}", nxt, groups.act_groups[(k, d)], device, inbox, t)
            links.grad_in = LinkReceiver(
                f"grad-recv-{k}", BACKWARD, nxt, groups.grad_groups[(k, d)], device, inbox, t,
                compute_device=cd,
            )
        if k > 0 or (chunks > 1 and L.P > 1):
            j = (k - 1) % L.P
            prv = L.rank_of(j, d)
            links.act_in = LinkReceiver(
                f"act-recv-{k}", FORWARD, prv, groups.act_groups[(j, d)], device, inbox, t,
                compute_device=cd,
            )
            links.grad_out = LinkSender(
                f"grad-send-{k}", prv, groups.grad_groups[(j, d)], device, inbox, t
            )
        return links

    def begin_step(self, num_microbatches: int, *, train: bool) -> None:
        """Wait for last step's sends (all received by now: the step ended everywhere) and post
        this step's receives."""
        for sender in (self.act_out, self.grad_out):
            if sender is not None:
                sender.flush()
        acts, grads = self.per_mb
        if self.act_in is not None:
            self.act_in.expect(num_microbatches * acts)
        if self.grad_in is not None and train:
            self.grad_in.expect(num_microbatches * grads)

    def close(self) -> None:
        """Stop the receivers, let outstanding sends finish, then drop the endpoints (and with them
        their groups and the tensors of their last messages)."""
        for w in (self.act_out, self.grad_out, self.act_in, self.grad_in):
            if w is not None:
                w.close()
        self.act_out = self.grad_out = self.act_in = self.grad_in = None
