"""Deterministic mode: weights bit-for-bit identical whatever P×D, across morphs.

Note [Canonical reduction]: floating-point addition is not associative, so a gradient summed
over micro-batches in execution order, then all-reduced over a ring of D replicas, depends on D
and on the order tasks happened to run. In deterministic mode every sum has one fixed shape:

* Per parameter, the mini-batch gradient is the sum of the per-micro-batch gradients g_0..g_{N-1}
  (N = global micro-batch count, fixed because m and M_total are fixed) along a canonical binary
  tree: node (level l, index k) covers micro-batches [k·2^l, (k+1)·2^l) and its value is
  left + right (a node whose right half is empty passes its left child through). A replica owning
  micro-batches [a, b) computes every node inside [a, b) locally, as each backward finishes
  (:class:`TreeAccumulator`, O(log N) partial sums alive), leaving the nodes that straddle replica
  boundaries.
* Across replicas (:func:`canonical_allreduce`): the flat gradient is cut into D shards; an
  all-to-all gives replica j every replica's partial nodes for shard j; replica j finishes the tree
  on its shard; an all-gather reassembles the result — a reduce-scatter + all-gather, like a ring
  all-reduce, but the additions follow the tree, not the ring. Cost: each partial node travels once
  (≤ 2·log2 N of them per replica instead of one buffer), and that many gradient copies in memory.
* A parameter read by several segments (tied embeddings) gets one autograd leaf per segment
  (aliases sharing its storage), so each segment's contribution is tree-summed on its own; the
  totals are then added in segment order — the same formula at 1×1 and at any P.
* The global gradient norm and the reported loss use a one-contributor-per-slot all-reduce: each
  segment's sum of squares (and each micro-batch's loss) is produced by exactly one rank, others
  add zeros, which is exact; the slots are then summed in segment (micro-batch) order.

Example::

    >>> import torch
    >>> acc = TreeAccumulator(num_leaves=3, lo=0, hi=3)
    >>> for i in (2, 0, 1):  # any arrival order gives the same bits
    ...     acc.add(i, torch.tensor([float(i)]))
    >>> acc.result().item()
    3.0
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch
import torch.distributed as dist

from varuna.core.env import ProcessEnv

__all__ = [
    "CUBLAS_DETERMINISTIC",
    "cuda_deterministic_env",
    "deterministic_kernels",
    "TreeAccumulator",
    "combine_nodes",
    "canonical_allreduce",
    "tree_levels",
    "DeterminismError",
    "first_difference",
]


#: cuBLAS workspace settings under which its results do not depend on scheduling (CUDA >= 10.2):
#: ``:4096:8`` (8 buffers of 4 MiB) or ``:16:8`` (less memory, slower).
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")

# Note [Deterministic CUDA]: ``torch.use_deterministic_algorithms(True)`` makes PyTorch refuse
# kernels without a deterministic implementation, and raise at the first cuBLAS matmul unless
# ``CUBLAS_WORKSPACE_CONFIG`` is one of :data:`CUBLAS_DETERMINISTIC` -- cuBLAS otherwise splits
# work across its workspace in a stream-dependent way (CUDA docs, "Results reproducibility"). The
# variable is read when the process creates its cuBLAS handle and sizes PyTorch's workspace
# (once), so it must be in the environment before the process's first CUDA matmul: the engine sets
# it (:func:`cuda_deterministic_env`) first thing in its constructor, before its dry run or any
# kernel; a script that runs CUDA matmuls of its own before building the engine must export it
# itself (docs/determinism.md). cuDNN's autotuner may pick a different (each deterministic)
# algorithm per run, so ``cudnn.benchmark`` is turned off too.


def cuda_deterministic_env(env: ProcessEnv | None = None,
                           environ: MutableMapping[str, str] | None = None) -> str:
    """Put ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in ``environ`` (default ``os.environ``, which
    cuBLAS reads) unless the user set a deterministic value (Note [Deterministic CUDA]); another
    value is a ``ValueError`` (one line). ``env``: this process's parsed environment (default:
    parsed from ``environ``). Returns the value in force. Harmless without CUDA.

    >>> env = {}
    >>> cuda_deterministic_env(environ=env), env
    (':4096:8', {'CUBLAS_WORKSPACE_CONFIG': ':4096:8'})
    """
    env = ProcessEnv.from_env(environ) if env is None else env
    value = env.cublas_workspace_config
    if value is None:
        # cuBLAS reads the process environment when it creates its handle: the choice goes there.
        if environ is None:
            os.environ.update({"CUBLAS_WORKSPACE_CONFIG": CUBLAS_DETERMINISTIC[0]})
        else:
            environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
        return CUBLAS_DETERMINISTIC[0]
    if value not in CUBLAS_DETERMINISTIC:
        raise ValueError(
            f"deterministic mode needs CUBLAS_WORKSPACE_CONFIG={CUBLAS_DETERMINISTIC[0]} (or "
            f"{CUBLAS_DETERMINISTIC[1]}), but it is {value!r}: unset it or set one of those"
        )
    return value


def deterministic_kernels(threads: int) -> None:
    """Deterministic kernels in this process (Note [Deterministic CUDA]): PyTorch's deterministic
    algorithms, no cuDNN autotuning, and ``threads`` intra-op CPU threads (a CPU kernel's
    summation order may depend on the thread count). ``CUBLAS_WORKSPACE_CONFIG`` must already be
    in force (:func:`cuda_deterministic_env`, which the engine calls first thing)."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.set_num_threads(threads)


class DeterminismError(RuntimeError):
    """Deterministic mode cannot keep its promise for this model (Note [Deterministic forward] in
    varuna/runtime/executor.py): a stage's recompute did not reproduce what its forward sent."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Bytes, not values: NaN == NaN and -0.0 != 0.0, as "bit-identical" means.
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def first_difference(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> str | None:
    """None when ``a`` and ``b`` are bitwise equal, else a short description of the first difference.

    Example::

        >>> first_difference((torch.ones(2),), (torch.tensor([1.0, 1.5]),))
        'tensor 0 of 1, shape (2,) torch.float32: 1 element(s) differ, max |diff| 5.0e-01'
    """
    if len(a) != len(b):
        return f"{len(a)} tensor(s) sent, {len(b)} recomputed"
    for i, (x, y) in enumerate(zip(a, b)):
        head = f"tensor {i} of {len(a)}, shape {tuple(x.shape)} {x.dtype}"
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{head} against shape {tuple(y.shape)} {y.dtype}"
        if torch.equal(_bits(x), _bits(y)):
            continue
        ne = x.ne(y) if not x.is_floating_point() else ~(x.eq(y) | (x.isnan() & y.isnan()))
        count = int(ne.sum())
        if x.is_floating_point():
            gap = (x.double() - y.double()).abs().nan_to_num(nan=float("inf")).max().item()
            return f"{head}: {count} element(s) differ, max |diff| {gap:.1e}"
        return f"{head}: {count} element(s) differ"
    return None


def tree_levels(num_leaves: int) -> int:
    """Height of the canonical tree over ``num_leaves`` leaves (root level)."""
    return max(num_leaves - 1, 0).bit_length()


def _span(level: int, index: int, n: int) -> tuple[int, int]:
    return index << level, min((index + 1) << level, n)


def combine_nodes(nodes: dict[tuple[int, int], torch.Tensor], num_leaves: int) -> torch.Tensor:
    """Finish the canonical tree given nodes that partition [0, num_leaves)."""
    nodes = dict(nodes)
    root = (tree_levels(num_leaves), 0)
    while root not in nodes:
        level, index = min(nodes)  # lowest level first: its sibling cannot still be split
        value = nodes.pop((level, index))
        sib = (level, index ^ 1)
        lo, hi = _span(level, index ^ 1, num_leaves)
        if lo >= hi:
            merged = value  # empty right half: pass through
        else:
            other = nodes.pop(sib)
            merged = value + other if index % 2 == 0 else other + value
        nodes[(level + 1, index >> 1)] = merged
    return nodes[root]


class TreeAccumulator:
    """Sums per-micro-batch values along the canonical tree; this replica owns leaves [lo, hi)."""

    def __init__(self, num_leaves: int, lo: int, hi: int):
        self.n, self.lo, self.hi = num_leaves, lo, hi
        self.root = (tree_levels(num_leaves), 0)
        self.nodes: dict[tuple[int, int], torch.Tensor] = {}

    def add(self, leaf: int, value: torch.Tensor) -> None:
        if not self.lo <= leaf < self.hi:
            raise ValueError(f"micro-batch {leaf} is not in this replica's range [{self.lo}, {self.hi})")
        level, index = 0, leaf
        while (level, index) != self.root:
            plo, phi = _span(level + 1, index >> 1, self.n)
            if plo < self.lo or phi > self.hi:
                break  # the parent straddles another replica: finished across replicas
            slo, shi = _span(level, index ^ 1, self.n)
            if slo < shi:
                other = self.nodes.pop((level, index ^ 1), None)
                if other is None:
                    break  # sibling not computed yet
                value = value + other if index % 2 == 0 else other + value
            level, index = level + 1, index >> 1
        self.nodes[(level, index)] = value

    def partial_nodes(self) -> dict[tuple[int, int], torch.Tensor]:
        return dict(self.nodes)

    def result(self) -> torch.Tensor:
        """The root (only when this replica owns every leaf)."""
        return combine_nodes(self.nodes, self.n)


def canonical_allreduce(
    nodes: dict[tuple[int, int], torch.Tensor], num_leaves: int, group, group_size: int, my_index: int
) -> torch.Tensor:
    """Canonical-tree sum over replicas of flat 1-D partial nodes (see Note [Canonical reduction])."""
    if group_size == 1:
        return combine_nodes(nodes, num_leaves)
    numel = next(iter(nodes.values())).numel()
    dtype = next(iter(nodes.values())).dtype
    # The gradients stay on their device (a CUDA stage's went through the host and came back as CPU
    # gradients of CUDA parameters); the node ids are host bookkeeping (the group's gloo part).
    device = next(iter(nodes.values())).device
    maxn = 2 * (tree_levels(num_leaves) + 1)
    ids = torch.full((maxn, 2), -1, dtype=torch.int64)
    stacked = torch.zeros(maxn, numel, dtype=dtype, device=device)
    for row, (key, t) in enumerate(sorted(nodes.items())):
        ids[row, 0], ids[row, 1] = key
        stacked[row] = t
    all_ids = [torch.empty_like(ids) for _ in range(group_size)]
    dist.all_gather(all_ids, ids, group=group)
    bounds = [(numel * j) // group_size for j in range(group_size + 1)]
    send = torch.cat([stacked[:, bounds[j] : bounds[j + 1]].reshape(-1) for j in range(group_size)])
    mine = bounds[my_index + 1] - bounds[my_index]
    recv = torch.empty(maxn * mine * group_size, dtype=dtype, device=device)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[maxn * mine] * group_size,
        input_split_sizes=[maxn * (bounds[j + 1] - bounds[j]) for j in range(group_size)],
        group=group,
    )
    blocks = recv.view(group_size, maxn, mine)
    shard_nodes = {}
    for r in range(group_size):
        for row in range(maxn):
            level, index = all_ids[r][row].tolist()
            if level >= 0:
                shard_nodes[(level, index)] = blocks[r, row]
    shard = combine_nodes(shard_nodes, num_leaves)
    width = max(bounds[j + 1] - bounds[j] for j in range(group_size))
    padded = torch.zeros(width, dtype=dtype, device=device)
    padded[:mine] = shard
    gathered = [torch.empty(width, dtype=dtype, device=device) for _ in range(group_size)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([gathered[j][: bounds[j + 1] - bounds[j]] for j in range(group_size)])


class DeterministicGrads:
    """The engine side of deterministic mode (Note [Canonical reduction]).

    Owns the per-segment aliases of shared parameters, captures each micro-batch's gradients
    into a :class:`TreeAccumulator`, and replaces the engine's gradient all-reduce, norm and loss
    reduction with canonical-order versions.
    """

    def __init__(
        self,
        *,
        model,
        profile,
        trainable: dict,
        first_segment: int,
        last_segment: int,
        layout,
        stage_ranges: list[tuple[int, int]],
    ) -> None:
        from torch import nn

        self.trainable = trainable
        self.profile, self.layout, self.stage_ranges = profile, layout, stage_ranges
        self.first_segment = first_segment
        #: the engine's process groups (``varuna.runtime.groups.ProcessGroups``), set once built
        self.groups = None
        prof = profile
        # This process's segments: its stage's range, or (interleaved: P·v virtual stages, v chunks
        # per process) the ranges of virtual stages stage, stage + P, ...
        mine = {s for a, b in stage_ranges[layout.stage :: layout.P] for s in range(a, b + 1)}
        self._parts: dict[int, dict[int, torch.Tensor]] = {}
        self.aliases: dict[str, dict[int, nn.Parameter]] = {}
        for n, p in trainable.items():
            segs = prof.param_segments.get(n, ())
            if len(segs) > 1:
                # One autograd leaf per reading segment, sharing the parameter's storage: the
                # optimizer's in-place update of the parameter is seen by every alias.
                self.aliases[n] = {
                    s: nn.Parameter(p.detach(), requires_grad=True) for s in segs if s in mine
                }
        owners = {id(p): n for n, p in trainable.items() if n in self.aliases}
        self.regs: dict[str, list[tuple[nn.Module, str]]] = {n: [] for n in self.aliases}
        for mod in model.modules():
            for attr, p in mod._parameters.items():
                if p is not None and id(p) in owners:
                    self.regs[owners[id(p)]].append((mod, attr))
        self.leaves: list[tuple[str, int | None, torch.Tensor]] = []
        for n, p in trainable.items():
            if n in self.aliases:
                self.leaves += [(n, s, a) for s, a in sorted(self.aliases[n].items())]
            else:
                self.leaves.append((n, None, p))
        self.acc: TreeAccumulator | None = None
        self.losses: dict[int, float] = {}

    # -- forward: route each segment's reads of a shared parameter to that segment's alias
    def on_segment(self, segment: int) -> None:
        for n, per_seg in self.aliases.items():
            target = per_seg.get(segment, self.trainable[n])
            for mod, attr in self.regs[n]:
                mod._parameters[attr] = target

    def restore(self) -> None:
        for n in self.aliases:
            for mod, attr in self.regs[n]:
                mod._parameters[attr] = self.trainable[n]

    # -- backward: one tree leaf per micro-batch
    def begin_step(self, mbs, num_microbatches: int) -> None:
        self.acc = TreeAccumulator(num_microbatches, mbs[0].index, mbs[-1].index + 1)
        self.losses = {}
        self.n = num_microbatches

    def capture(self, microbatch: int, *, last: bool = True) -> None:
        """After a backward of ``microbatch``: take its gradients; ``last=False`` (an interleaved
        process's earlier chunks) keeps them as a part until its last chunk's backward. A chunk's
        backward fills only its own leaves (a shared parameter has one alias per segment), so the
        row takes each leaf from the one part that has it: no addition, bits as in one process."""
        got = self._parts.pop(microbatch, {})
        for j, (_, _, t) in enumerate(self.leaves):
            if t.grad is not None:
                got[j] = t.grad if j not in got else got[j] + t.grad
                t.grad = None
        if not last:
            self._parts[microbatch] = got
            return
        flat = torch.cat(
            [(got[j] if j in got else torch.zeros_like(t)).reshape(-1)
             for j, (_, _, t) in enumerate(self.leaves)]
        )
        self.acc.add(microbatch, flat)

    def reduce(self) -> None:
        """Canonical mini-batch gradients into every trainable parameter's ``.grad``."""
        flat = canonical_allreduce(
            self.acc.partial_nodes(), self.n, self.groups.dp_group, self.layout.D, self.layout.replica
        )
        per_seg: dict[str, dict[int, torch.Tensor]] = {}
        pos = 0
        for n, s, t in self.leaves:
            g = flat[pos : pos + t.numel()].view_as(t)
            pos += t.numel()
            if s is None:
                self.trainable[n].grad = g.clone()
            else:
                per_seg.setdefault(n, {})[s] = g
        for n, rows in per_seg.items():
            segs = self.profile.param_segments[n]
            rows = self._gather_segments(n, segs, rows)
            total = rows[segs[0]].clone()
            for s in segs[1:]:
                total = total + rows[s]  # segment order, at any P
            self.trainable[n].grad = total
        self.acc = None

    def _gather_segments(self, n, segs, rows):
        layout = self.layout
        if all(s in rows for s in segs):
            return rows
        from varuna.core.partition import stage_of_segment

        P = layout.P
        seg_stage = [k % P for k in stage_of_segment(self.stage_ranges)]  # virtual stage -> process
        stages = sorted({seg_stage[s] for s in segs})
        ranks = sorted(layout.rank_of(k, d) for k in stages for d in range(layout.D))
        group = next(g for g, names in self.groups.shared if n in names)
        like = next(iter(rows.values()))
        mine = torch.zeros(len(segs), *like.shape, dtype=like.dtype, device=like.device)
        for i, s in enumerate(segs):
            if s in rows:
                mine[i] = rows[s]
        out = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(out, mine, group=group)
        full = {}
        for i, s in enumerate(segs):
            src = ranks.index(next(r for r in ranks if seg_stage[s] == r % layout.P))
            full[s] = out[src][i]
        return full

    def scalar_slots(self, nonfinite: bool, stop: bool, norm_elsewhere: set[str]) -> torch.Tensor:
        """[per-segment sum of squares..., nonfinite, stop, per-micro-batch loss...] with exactly
        one contributing rank per slot, so a SUM all-reduce is exact."""
        nseg = self.profile.num_segments
        v = torch.zeros(nseg + 2 + self.n, dtype=torch.float64)
        if self.layout.replica == 0:
            slots, squares = [], []
            for n, p in self.trainable.items():
                if n in norm_elsewhere:
                    continue
                slots.append(self.profile.param_segments.get(n, (self.first_segment,))[0])
                squares.append(torch.linalg.vector_norm(p.grad).double() ** 2)
            # One copy to the host (a CUDA stage's norms are on its device); added in the same
            # order as ever, in float64 either way: the same bits.
            values = torch.stack(squares).cpu().tolist() if squares else []
            for s0, sq in zip(slots, values):
                v[s0] += sq
        v[nseg] = float(nonfinite)
        v[nseg + 1] = float(stop)
        for g, loss in self.losses.items():
            v[nseg + 2 + g] = loss
        return v

    def read_slots(
        self, v: list[float], mb_sizes: list[int], global_batch: int
    ) -> tuple[float, bool, float, bool]:
        nseg = self.profile.num_segments
        total_sq = 0.0
        for s in range(nseg):
            total_sq += v[s]
        loss = 0.0
        for g in range(self.n):
            loss += v[nseg + 2 + g] * mb_sizes[g] / global_batch
        return total_sq, v[nseg] > 0, loss, v[nseg + 1] > 0
