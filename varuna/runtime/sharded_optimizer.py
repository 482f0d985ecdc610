"""Sharded optimizer state (ZeRO-1) and optimizer-state offload for one stage.

Each of a stage's D replicas keeps and steps the optimizer state of one flat, aligned shard of
the stage's parameters (Note [Optimizer shards] in varuna/core/shard_layout.py); the parameters
are views of one flat buffer, so the updated shards are all-gathered straight into them. The
user's optimizer object stays the engine's ``optimizer``: its parameter groups (and with them
their hyper-parameters, what LR schedulers change) are kept, holding this replica's *pieces*
instead of whole parameters. With ``offload`` the pieces, their gradients and their state live
in host memory (pinned when the parameters are on an accelerator) and are stepped there; only
the updated values go back to the device.

Gradients reach the pieces one of two ways (``reduce_scatter``): summed over the replicas by the
usual all-reduce and then read as views of the whole gradients, or reduce-scattered in buckets so
that each replica receives only its shard's sum (half an all-reduce's traffic; the all-gather of
the weights is the other half). Deterministic mode always takes the first (the canonical
reduction, Note [Canonical reduction] in determinism.py, gives every replica the whole canonical
sums, and the global norm is taken per parameter as in one process): the update of each element
is then the one-process update bit for bit, because the accepted optimizers are elementwise.

Checkpoints and live morphs see the state by parameter name, whole, as without sharding
(:meth:`ShardedOptimizer.state_by_name`, a collective that gathers each parameter's state to the
replicas that ask for it; :meth:`ShardedOptimizer.load_state_by_name` keeps this replica's
pieces of a whole state): a checkpoint saved sharded at 2×4 resumes unsharded at 4×1 and back.

Example::

    flat = FlatParameters(trainable, num_shards=D)           # parameters become views of one buffer
    opt = torch.optim.AdamW(list(trainable.values()), lr=1e-3)
    shards = ShardedOptimizer(flat, opt, index=replica, group=dp_group, ranks=dp_ranks)
    ...                                                      # backward, gradient all-reduce
    shards.bind_grads()                                      # this replica's pieces of the gradients
    shards.step()                                            # step the pieces, all-gather the weights
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from varuna.core.memory import GRAD_BUCKET_BYTES
from varuna.core.shard_layout import Piece, ShardLayout
from varuna.runtime.optimizer_state import load_optimizer_state_by_name, optimizer_state_by_name

__all__ = ["ELEMENTWISE_OPTIMIZERS", "FlatParameters", "ShardedOptimizer", "load_stage_optimizer_state",
           "stage_optimizer_state", "unshardable"]

#: Optimizers whose update of an element reads only that element's gradient and state (and
#: per-parameter scalars such as the step count), so that stepping a piece of a parameter gives
#: the bits of stepping the whole one. LAMB/LARS (a per-tensor trust ratio), Adafactor (factored
#: row and column statistics), Muon (orthogonalised matrices) and L-BFGS are not.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
)

_BUCKET_BYTES = GRAD_BUCKET_BYTES  # per reduce-scatter/all-gather bucket, as the all-reduce's


def unshardable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be sharded or offloaded (one line), or None.

    >>> unshardable(torch.optim.AdamW([nn.Parameter(torch.ones(1))]))
    >>> unshardable(torch.optim.LBFGS([nn.Parameter(torch.ones(1))]))  # doctest: +ELLIPSIS
    'optimizer LBFGS is not elementwise...'
    """
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        return (f"optimizer {type(optimizer).__name__} is not elementwise, so its state cannot be sharded "
                f"or offloaded bit for bit; use one of {names}, or turn optimizer_state.shard and "
                "optimizer_state.offload off")
    return None


class FlatParameters:
    """The stage's trainable parameters turned into views of one flat buffer laid out by a
    :class:`ShardLayout` (Note [Optimizer shards]); built before anything else holds the
    parameters' storage (deterministic mode's per-segment aliases share it)."""

    @classmethod
    def for_stage(
        cls, trainable: Mapping[str, nn.Parameter], settings, replicas: int
    ) -> FlatParameters | None:
        """The engine's: None unless ``settings`` (``VarunaConfig.optimizer_state``) shards or
        offloads; one shard per replica when sharded."""
        if not (settings.shard or settings.offload):
            return None
        return cls(trainable, replicas if settings.shard else 1)

    def __init__(self, trainable: Mapping[str, nn.Parameter], num_shards: int) -> None:
        params = list(trainable.values())
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                "sharded or offloaded optimizer state needs the stage's trainable parameters in one dtype "
                f"on one device (found {sorted(map(str, dtypes))} on {sorted(map(str, devices))}); cast "
                "the model first, or turn optimizer_state.shard and optimizer_state.offload off"
            )
        self.params = dict(trainable)
        self.layout = ShardLayout.of({n: p.numel() for n, p in trainable.items()}, num_shards)
        dtype = params[0].dtype if params else torch.float32
        device = params[0].device if params else torch.device("cpu")
        self.buffer = torch.zeros(self.layout.total, dtype=dtype, device=device)
        with torch.no_grad():
            for (_n, p), off in zip(trainable.items(), self.layout.offsets):
                view = self.buffer[off : off + p.numel()]
                view.copy_(p.reshape(-1))
                p.data = view.view_as(p)  # the old storage goes once nothing else holds it


class ShardedOptimizer:
    """This replica's shard of the stage's optimizer (see the module docstring).

    ``index``/``ranks``: this replica's position among the stage's replicas and their global
    ranks (``group`` their process group, None when D == 1). ``reduce_scatter``: gradients come
    reduce-scattered (:meth:`reduce_scatter_grads`) instead of as views of all-reduced ones.
    ``shared``: names of parameters other stages also hold (tied weights), whose gradients are
    summed over their own group, never reduce-scattered here."""

    def __init__(
        self,
        flat: FlatParameters,
        optimizer: torch.optim.Optimizer,
        *,
        index: int = 0,
        group=None,
        ranks: list[int] | None = None,
        offload: bool = False,
        reduce_scatter: bool = False,
        shared: Iterable[str] = (),
    ) -> None:
        reason = unshardable(optimizer)
        if reason is not None:
            raise ValueError(reason)
        self.flat, self.layout, self.optimizer = flat, flat.layout, optimizer
        self.index, self.group = index, group
        self.ranks = list(ranks) if ranks is not None else [0]
        self.offload, self.reduce_scatter = offload, reduce_scatter
        self.shared = frozenset(shared)
        self.pieces: list[Piece] = self.layout.pieces(index)
        self.lo, self.hi = self.layout.shard_range(index)
        name_of = {id(p): n for n, p in flat.params.items()}
        self.group_names: list[list[str]] = []
        for g in optimizer.param_groups:
            if any(id(p) not in name_of for p in g["params"]):
                raise ValueError("the optimizer holds a parameter that is not among the engine's parameters; "
                                 "build it from the parameters the engine passes to the optimizer factory")
            self.group_names.append([name_of[id(p)] for p in g["params"]])
        pin = offload and flat.buffer.device.type != "cpu"
        #: this replica's pieces as the optimizer's parameters, by parameter name
        self.by_name: dict[str, nn.Parameter] = {}
        for pc in self.pieces:
            view = self._view(pc)
            if offload:  # a host copy of its own: the optimizer never touches device memory
                host = torch.empty(view.shape, dtype=view.dtype, pin_memory=pin)
                host.copy_(view)
                view = host
            self.by_name[pc.name] = nn.Parameter(view, requires_grad=True)
        # State the optimizer made in its constructor (Adagrad's sums) goes to the pieces too.
        made = {name_of[id(p)]: optimizer.state.pop(p) for p in list(optimizer.state)}
        for g, names in zip(optimizer.param_groups, self.group_names):
            g["params"] = [self.by_name[n] for n in names if n in self.by_name]
            if "param_names" in g:
                g["param_names"] = [n for n in names if n in self.by_name]
        for pc in self.pieces:
            if pc.name in made:
                optimizer.state[self.by_name[pc.name]] = self._slice_state(pc, made[pc.name], copy=True)
        self._grad_shard: torch.Tensor | None = None
        self._gathered: dict | None = None
        self._host_grads: dict[str, torch.Tensor] = {}

    @classmethod
    def for_stage(cls, flat: FlatParameters | None, optimizer: torch.optim.Optimizer, layout, groups,
                  settings, device: torch.device, canonical: bool, *,
                  backend: str | None = None) -> ShardedOptimizer | None:
        """The engine's shard of ``optimizer`` (None without ``flat``): this replica's among the
        stage's (``layout``, ``groups``: its process groups), as ``settings``
        (``VarunaConfig.optimizer_state``) say. ``canonical``: deterministic mode sums
        gradients canonically, whole (never reduce-scattered). ``grad_reduce="auto"``:
        reduce-scatter on an accelerator over NCCL, all-reduce on gloo (whose reduce-scatter measured
        slower: docs/memory.md), also for a CUDA stage whose groups are gloo's (``backend="gloo"``:
        processes sharing a GPU, ``varuna.runtime.layout.Transport``)."""
        if flat is None:
            return None
        sharded = settings.shard and layout.D > 1
        reduce = settings.grad_reduce
        if reduce == "auto":
            reduce = "reduce_scatter" if device.type == "cuda" and backend != "gloo" else "all_reduce"
        return cls(
            flat,
            optimizer,
            index=layout.replica if sharded else 0,
            group=groups.dp_group if sharded else None,
            ranks=[layout.rank_of(layout.stage, d) for d in range(layout.D)] if sharded else [layout.rank],
            offload=settings.offload,
            reduce_scatter=sharded and reduce == "reduce_scatter" and not canonical,
            shared=groups.shared_names(),
        )

    # -- the pieces

    def _view(self, pc: Piece) -> torch.Tensor:
        """Piece ``pc`` of the flat buffer: shaped as its parameter when it is the whole parameter
        (the optimizer then sees what it would without sharding), flat otherwise."""
        p = self.flat.params[pc.name]
        view = self.flat.buffer[pc.flat : pc.flat + pc.numel]
        return view.view_as(p) if pc.numel == p.numel() else view

    def _grad_view(self, pc: Piece, grad: torch.Tensor) -> torch.Tensor:
        p = self.flat.params[pc.name]
        return grad if pc.numel == p.numel() else grad.reshape(-1)[pc.start : pc.stop]

    def parameters(self) -> list[nn.Parameter]:
        """The optimizer's parameters: this replica's pieces."""
        return list(self.by_name.values())

    # -- gradients

    def bind_grads(self) -> list[torch.Tensor]:
        """Give each piece its gradient: views of the (summed) whole gradients, or after
        :meth:`reduce_scatter_grads`, of this replica's shard; host copies when offloaded.
        Returns the pieces' gradients (what unscaling and clipping multiply)."""
        out = []
        for pc in self.pieces:
            piece = self.by_name[pc.name]
            if self._grad_shard is not None and pc.name not in self.shared:
                g = self._grad_shard[pc.flat - self.lo : pc.flat - self.lo + pc.numel].view(piece.shape)
            else:
                p = self.flat.params[pc.name]
                g = self._grad_view(pc, p.grad if p.grad is not None else torch.zeros_like(p))
            if self.offload:  # into a host buffer of its own, made once (pinned beside an accelerator)
                host = self._host_grads.get(pc.name)
                if host is None:
                    host = torch.empty(piece.shape, dtype=g.dtype, pin_memory=g.is_cuda)
                    self._host_grads[pc.name] = host
                host.copy_(g.view(piece.shape))
                g = host
            piece.grad = g.view(piece.shape)
            out.append(piece.grad)
        return out

    def reduce_scatter_grads(self) -> None:
        """Sum the stage's gradients over its replicas, keeping only this replica's shard (the
        shared parameters' regions are left to their own all-reduce: zeros here). In buckets of
        at most 32 MiB of input: bucket k holds elements ``[k·B, (k+1)·B)`` of every shard."""
        L, D = self.layout, self.layout.num_shards
        S = L.shard_numel
        dtype, device = self.flat.buffer.dtype, self.flat.buffer.device
        out = torch.empty(S, dtype=dtype, device=device)
        step = max(self.layout.align, (_BUCKET_BYTES // max(1, D * self.flat.buffer.element_size())))
        for a in range(0, S, step):
            b = min(S, a + step)
            send = torch.zeros(D, b - a, dtype=dtype, device=device)
            for j in range(D):
                self._fill(send[j], j * S + a, j * S + b)
            if self.group is not None and D > 1:
                dist.reduce_scatter_single(out[a:b], send.reshape(-1), group=self.group)
            else:
                out[a:b].copy_(send[0])
        self._grad_shard = out

    def _fill(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        """``dst`` = the local gradients of flat elements ``[lo, hi)`` (zeros elsewhere)."""
        for name, off, n in zip(self.layout.names, self.layout.offsets, self.layout.numels):
            a, b = max(lo, off), min(hi, off + n)
            if a >= b or name in self.shared:
                continue
            g = self.flat.params[name].grad
            if g is not None:
                dst[a - lo : b - lo].copy_(g.reshape(-1)[a - off : b - off])

    def local_norms(self, elsewhere: set[str]) -> tuple[torch.Tensor, float]:
        """After :meth:`bind_grads` with reduce-scattered gradients: this replica's sum of squared
        gradient elements (each element is in one shard; parameters another stage counts are
        left out), and 1.0 if any of its elements is not finite."""
        grads = [self.by_name[pc.name].grad for pc in self.pieces]
        counted = [self.by_name[pc.name].grad for pc in self.pieces if pc.name not in elsewhere]
        sumsq = torch.zeros((), dtype=torch.float64)
        nonfinite = 0.0
        if grads:
            norms = torch._foreach_norm(grads)
            nonfinite = 0.0 if bool(torch.isfinite(torch.stack([x.double() for x in norms]).sum())) else 1.0
        if counted:
            sumsq = torch.stack([x.double().cpu() ** 2 for x in torch._foreach_norm(counted)]).sum()
        return sumsq, nonfinite

    def zero_grad(self) -> None:
        """Drop the pieces' gradients (and the reduce-scattered shard)."""
        for piece in self.by_name.values():
            piece.grad = None
        self._grad_shard = None

    # -- the step

    def step(self) -> None:
        """Step this replica's pieces, then all-gather every replica's updated shard into the flat
        parameter buffer (the parameters are views of it)."""
        self.optimizer.step()
        if self.offload:
            with torch.no_grad():
                for pc in self.pieces:
                    self._view(pc).copy_(self.by_name[pc.name], non_blocking=True)
        self.zero_grad()
        if self.group is not None and self.layout.num_shards > 1:
            self._all_gather()

    def _all_gather(self) -> None:
        """Every replica's updated shard into the flat buffer, in place. NCCL: one in-place
        all-gather (the input is this rank's own slot of the output). gloo copies a tensor
        all-gather through a buffer as large as its output (measured: a whole stage's weights
        at once, which is what sharding saves), so there it runs in buckets of at most 32 MiB:
        bucket k gathers elements ``[k·B, (k+1)·B)`` of every shard into their places."""
        buf, S, D = self.flat.buffer, self.layout.shard_numel, self.layout.num_shards
        if dist.get_backend(self.group) == "nccl":
            dist.all_gather_single(buf, buf[self.lo : self.hi], group=self.group)
            return
        step = max(self.layout.align, _BUCKET_BYTES // (D * buf.element_size()))
        for a in range(0, S, step):
            b = min(S, a + step)
            outs = [buf[j * S + a : j * S + b] for j in range(D)]
            dist.all_gather(outs, outs[self.index], group=self.group)

    # -- state by parameter name (checkpoints, live morph)

    def gather_for_transfer(self) -> None:
        """Gather the whole state by name on every replica now, while the replicas' group is up
        (a live morph tears it down before it sends state: :meth:`state_by_name` then answers
        from this copy). One shard: nothing to gather."""
        if self.layout.num_shards > 1:
            self._gathered = self.state_by_name()

    def state_by_name(self, only: Iterable[str] | None = None) -> dict:
        """The optimizer state by parameter name, whole tensors shaped as the parameters, the same
        form as :func:`~varuna.runtime.optimizer_state.optimizer_state_by_name` without sharding.
        A collective over the stage's replicas when D > 1 (each gets the parameters in ``only``;
        None: all). D == 1: references to the live state, like ``Optimizer.state_dict``."""
        keep = set(self.layout.names) if only is None else set(only)
        if self._gathered is not None:
            g = self._gathered
            return {**g, "state": {n: v for n, v in g["state"].items() if n in keep},
                    "param_groups": _only_groups(g["param_groups"], keep)}
        groups = []
        for g, names in zip(self.optimizer.param_groups, self.group_names):
            picked = [n for n in names if n in keep]
            if picked:
                hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
                groups.append({**hyper, "params": picked})
        state = self._gather_state(keep)
        return {"class": type(self.optimizer).__name__, "state": state, "param_groups": groups}

    def _descriptor(self) -> list[list]:
        """[key, kind, dtype] of each state entry ("elem": one value per element, "scalar": one
        per parameter), from replica 0's largest piece; the same on every replica (broadcast as
        JSON: the receivers of an empty shard have no state to look at)."""
        desc: list[list] = []
        if self.index == 0 and self.pieces:
            pc = max(self.pieces, key=lambda p: p.numel)
            for key, v in sorted(self.optimizer.state.get(self.by_name[pc.name], {}).items()):
                if not isinstance(v, torch.Tensor):
                    raise ValueError(f"optimizer state {key!r} is not a tensor; it cannot be sharded")
                kind = "elem" if v.numel() == pc.numel and v.dim() >= 1 else "scalar"
                desc.append([key, kind, str(v.dtype).removeprefix("torch.")])
        if self.layout.num_shards == 1 or self.group is None:
            return desc
        raw = json.dumps(desc).encode()
        n = torch.tensor([len(raw)], dtype=torch.int64, device=self.flat.buffer.device)
        dist.broadcast(n, src=self.ranks[0], group=self.group)
        data = torch.zeros(int(n.item()), dtype=torch.uint8, device=self.flat.buffer.device)
        if self.index == 0:
            data.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        dist.broadcast(data, src=self.ranks[0], group=self.group)
        return json.loads(bytes(data.cpu().tolist()).decode())

    def _gather_state(self, keep: set[str]) -> dict[str, dict[str, torch.Tensor]]:
        desc = self._descriptor()
        if self.layout.num_shards == 1:
            return self._local_state(keep, desc)
        params = self.flat.params
        out: dict[str, dict[str, torch.Tensor]] = {}
        if desc:
            out = {n: {} for n in self.layout.names if n in keep}
        for key, kind, dt in desc:
            dtype = getattr(torch, dt)
            if kind == "elem":
                for n in out:
                    out[n][key] = torch.empty(params[n].shape, dtype=dtype)
            for j in range(self.layout.num_shards):
                self._gather_key(j, key, kind, dtype, out)
        return out

    def _local_state(self, keep: set[str], desc: list[list]) -> dict[str, dict[str, torch.Tensor]]:
        """D == 1: the live state of whole-parameter pieces, by reference."""
        state = {}
        for pc in self.pieces:
            st = self.optimizer.state.get(self.by_name[pc.name])
            if pc.name in keep and st:
                shape = self.flat.params[pc.name].shape
                state[pc.name] = {k: st[k].view(shape) if kind == "elem" else st[k] for k, kind, _ in desc}
        return state

    def _gather_key(self, j: int, key: str, kind: str, dtype: torch.dtype, out: dict) -> None:
        """Replica ``j``'s values of state entry ``key``, broadcast to the stage's replicas; each
        keeps those of the parameters in ``out``."""
        pieces = self.layout.pieces(j)
        if not pieces:
            return
        size = self.layout.shard_numel if kind == "elem" else len(pieces)
        buf = torch.zeros(size, dtype=dtype, device=self.flat.buffer.device)
        base = j * self.layout.shard_numel
        if j == self.index:
            for i, pc in enumerate(pieces):
                v = self.optimizer.state[self.by_name[pc.name]][key]
                if kind == "elem":
                    buf[pc.flat - base : pc.flat - base + pc.numel].copy_(v.reshape(-1))
                else:
                    buf[i] = v
        dist.broadcast(buf, src=self.ranks[j], group=self.group)
        buf = buf.cpu()
        for i, pc in enumerate(pieces):
            if pc.name not in out:
                continue
            at = pc.flat - base
            if kind == "elem":
                out[pc.name][key].view(-1)[pc.start : pc.stop] = buf[at : at + pc.numel]
            elif pc.start == 0:  # a per-parameter value: from the replica holding its first element
                out[pc.name][key] = buf[i].clone()

    def _slice_state(self, pc: Piece, st: Mapping, *, copy: bool) -> dict:
        """Piece ``pc``'s part of a whole parameter's state: per-element tensors (shaped as the
        parameter) sliced to the piece, a copy so the whole tensor can go; the rest as it is
        (cloned with ``copy``)."""
        shape = tuple(self.flat.params[pc.name].shape)
        whole = pc.numel == self.flat.params[pc.name].numel()
        out = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == shape and not whole:
                v = v.reshape(-1)[pc.start : pc.stop].clone()
            elif isinstance(v, torch.Tensor) and copy:
                v = v.clone()
            out[k] = v
        return out

    def load_state_by_name(self, state: dict, *, copy: bool = True) -> None:
        """Load a whole, name-keyed optimizer state (saved with or without sharding, at any
        layout): each piece takes its elements (a copy unless the piece is the whole parameter and
        ``copy`` is False), hyper-parameters go to the groups as without sharding."""
        self._gathered = None
        pieces = {pc.name: pc for pc in self.pieces}
        sliced = {n: self._slice_state(pieces[n], st, copy=copy)
                  for n, st in state.get("state", {}).items() if n in pieces}
        groups = _only_groups(state.get("param_groups", []), set(pieces))
        translated = {**state, "state": sliced, "param_groups": groups}
        load_optimizer_state_by_name(self.optimizer, self.by_name, translated, copy=False)


def _only_groups(groups: list[dict], keep: set[str]) -> list[dict]:
    out = []
    for g in groups:
        names = [n for n in g["params"] if n in keep]
        if names:
            out.append({**g, "params": names})
    return out


def stage_optimizer_state(
    optimizer: torch.optim.Optimizer, shards: ShardedOptimizer | None, named: Mapping[str, torch.Tensor],
    only: Iterable[str] | None = None,
) -> dict:
    """A stage's optimizer state by parameter name, whole (``Engine.optimizer_state``): gathered
    from the shards when there are (a collective then), else read as it is."""
    if shards is not None:
        return shards.state_by_name(only)
    return optimizer_state_by_name(optimizer, named, only=only)


def load_stage_optimizer_state(
    optimizer: torch.optim.Optimizer, shards: ShardedOptimizer | None, named: Mapping[str, torch.Tensor],
    state: dict, *, copy: bool = True,
) -> None:
    """Inverse of :func:`stage_optimizer_state`: with shards, each keeps its pieces of each tensor."""
    if shards is not None:
        shards.load_state_by_name(state, copy=copy)
    else:
        load_optimizer_state_by_name(optimizer, named, state, copy=copy)
