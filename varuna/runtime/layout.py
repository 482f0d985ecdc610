"""Who this process is in the P×D grid, and the process group that connects it to the others.

The rank layout is the launcher's (Note [Rank layout] in varuna/core/env.py): ``rank = replica * P
+ stage``; :class:`Layout` delegates to :func:`varuna.core.env.rank_of` and
:func:`~varuna.core.env.stage_and_replica`, so the launcher and the engine cannot disagree.

Example::

    >>> layout = Layout(world=4, rank=3, P=2, D=2)
    >>> layout.stage, layout.replica, layout.rank_of(0, 1)
    (1, 1, 2)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from varuna.core.env import ProcessEnv, rank_of, stage_and_replica
from varuna.core.netif import interface_towards

__all__ = ["GLOO_IFNAME_VAR", "Layout", "Transport", "choose_gloo_interface", "choose_transport",
           "init_distributed", "pick_device", "shares_device"]

#: gloo binds to this interface when set; else to what the host name resolves to.
GLOO_IFNAME_VAR = "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True)
class Layout:
    """This process's place: ``world`` = P×D processes, this one is ``rank``."""

    world: int
    rank: int
    P: int
    D: int

    @property
    def stage(self) -> int:
        return stage_and_replica(self.rank, self.P)[0]

    @property
    def replica(self) -> int:
        return stage_and_replica(self.rank, self.P)[1]

    def rank_of(self, stage: int, replica: int) -> int:
        """Global rank of ``stage`` in ``replica``."""
        return rank_of(stage=stage, replica=replica, pipeline_depth=self.P)


def _pipeline_depth(pipeline_depth: int | None, env: ProcessEnv, world: int) -> int:
    """P from the argument, else ``$VARUNA_PIPELINE_DEPTH``, else 1; under torchrun with several
    processes P must be stated, since P=1 silently replicates the whole model on every process."""
    P = pipeline_depth or env.pipeline_depth
    if P is None and world > 1 and env.torchrun:
        raise ValueError(
            f"torchrun started {world} processes but no pipeline depth is set: export "
            "VARUNA_PIPELINE_DEPTH=P (P=1: data parallelism only) or pass VarunaConfig(pipeline_depth=P)"
        )
    return P or 1


def choose_gloo_interface(toward: str | None, env: ProcessEnv | None = None,
                          environ: dict[str, str] | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` in ``environ`` (default ``os.environ``, which gloo reads) to the
    interface that routes to ``toward`` (the rendezvous address), unless the user set it (Note
    [Interface towards a host] in varuna/core/netif.py: gloo would otherwise bind to what the host
    name resolves to, often a loopback address that no other host can reach). ``env``: this
    process's parsed environment (default: parsed from ``environ``). Returns the interface chosen,
    None when left as it was; raises ``ValueError`` (one line naming ``GLOO_SOCKET_IFNAME``) when
    no interface reaches it.

    Example::

        >>> env = {}
        >>> choose_gloo_interface("127.0.0.1", environ=env), env
        ('lo', {'GLOO_SOCKET_IFNAME': 'lo'})
    """
    env = ProcessEnv.from_env(environ) if env is None else env
    if env.gloo_ifname or not toward:
        return None
    try:
        name, _ = interface_towards(toward)
    except OSError as e:
        raise ValueError(
            f"cannot tell which network interface reaches the rendezvous address {toward} ({e}); set "
            f"{GLOO_IFNAME_VAR} to the interface gloo should use on this host (e.g. {GLOO_IFNAME_VAR}=eth0)"
        ) from None
    # gloo reads the process environment (as init_process_group does MASTER_ADDR): the choice goes there.
    if environ is None:
        os.environ.update({GLOO_IFNAME_VAR: name})
    else:
        environ[GLOO_IFNAME_VAR] = name
    return name


def init_distributed(
    pipeline_depth: int | None,
    data_parallel: int | None,
    *,
    device: str | None,
    timeout_s: float,
    env: ProcessEnv | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Layout, bool]:
    """Resolve P and D (arguments, else ``$VARUNA_PIPELINE_DEPTH`` / ``$VARUNA_DATA_PARALLEL``) and
    join the default process group when there are several processes and nobody joined it yet.
    The rest comes from torchrun's variables (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ...),
    which varuna-launch sets too, so a script runs under either (docs/launch.md, "Under torchrun").
    ``env``: this process's parsed environment (default: ``ProcessEnv.from_env(environ)``; P and
    D there, and in the engine's config, were checked where they were read). Returns the layout
    and whether this call created the process group (the engine then destroys it on close).

    Example::

        layout, owns = init_distributed(None, None, device="cpu", timeout_s=60.0, environ={})
        # Layout(world=1, rank=0, P=1, D=1), False
    """
    env = ProcessEnv.from_env(environ) if env is None else env
    world = dist.get_world_size() if dist.is_initialized() else env.world_size
    P = _pipeline_depth(pipeline_depth, env, world)
    D = data_parallel or env.data_parallel or max(world // P, 1)
    if world != P * D:
        how = (
            f"torchrun --nproc-per-node {P * D} on one node"
            if env.torchrun
            else f"varuna-launch --procs {P * D} --pipeline-depth {P}"
        )
        raise ValueError(
            f"world size {world} != pipeline depth {P} x data parallel {D}; launch P×D processes "
            f"({how}) or change P/D"
        )
    owns = False
    if world > 1 and not dist.is_initialized():
        # On GPUs both: NCCL for CUDA tensors (activations, gradients), gloo for the CPU ones
        # (the end-of-step agreement's scalars, the engine's small control all-reduces), which
        # NCCL alone refuses.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"
        choose_gloo_interface(env.master_addr, env, environ)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        owns = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Layout(world=world, rank=rank, P=P, D=D), owns


def pick_device(device: str | None, *, local_rank: int | None = None) -> torch.device:
    """``device`` if given, else ``cuda:local_rank`` (default ``$LOCAL_RANK``) when CUDA is
    available, else cpu; a CUDA device is made current (and given its index). More local
    processes than GPUs share them round-robin (``local_rank`` modulo the GPU count: two
    processes on one GPU, docs/gpu.md).

    Example::

        pick_device("cpu")   # device(type='cpu')
    """
    if device:
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
            torch.cuda.set_device(dev)
        return dev
    if torch.cuda.is_available():
        rank = ProcessEnv.from_env().local_rank if local_rank is None else local_rank
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def shares_device(device: torch.device, env: ProcessEnv | None = None, device_count: int | None = None,
                  environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process's GPU is (as far as it can tell) shared with another local process:
    more local processes (``LOCAL_WORLD_SIZE``) than GPUs, or a ``LOCAL_RANK`` past the last GPU.
    ``env``: this process's parsed environment (default: parsed from ``environ``).

    >>> shares_device(torch.device("cuda", 0), environ={"LOCAL_WORLD_SIZE": "2"}, device_count=1)
    True
    >>> shares_device(torch.device("cuda", 1), environ={"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"},
    ...               device_count=2)
    False
    """
    if device.type != "cuda":
        return False
    env = ProcessEnv.from_env(environ) if env is None else env
    count = torch.cuda.device_count() if device_count is None else device_count
    return env.local_world_size > count or env.local_rank >= count


@dataclass(frozen=True)
class Transport:
    """What carries the engine's traffic: the ``backend`` of its groups (None: the default
    group's) and the device its point-to-point messages live on."""

    backend: str | None
    link_device: torch.device
    description: str
    """One line for logs and tables, e.g. ``gloo, host-staged (2 processes share cuda:0)``."""


def choose_transport(layout: Layout, device: torch.device, requested: str | None = None,
                     env: ProcessEnv | None = None, *, environ: Mapping[str, str] | None = None) -> Transport:
    """The :class:`Transport` of an engine on ``device`` (``VarunaConfig.comm_backend``, else
    ``$VARUNA_COMM_BACKEND`` -- ``env.settings.comm_backend``, ``env`` default parsed from
    ``environ`` --, else automatic). A CPU stage: gloo. A CUDA stage: NCCL, unless some
    process of the job shares its GPU -- NCCL refuses two ranks on one device -- or gloo is asked
    for; then gloo for every group, with point-to-point messages staged through pinned host memory
    (gloo's send/recv cannot take CUDA tensors: Note [Host-staged CUDA messages] in comm.py). The
    automatic choice is agreed by all ranks (one small all-reduce), so one rank sharing its GPU
    moves the whole job to gloo.

    Example::

        choose_transport(Layout(world=1, rank=0, P=1, D=1), torch.device("cpu")).description  # 'gloo'
    """
    env = ProcessEnv.from_env(environ) if env is None else env
    want = requested or env.settings.comm_backend
    if device.type != "cuda":
        if want == "nccl":
            raise ValueError("comm_backend='nccl' needs CUDA devices; this engine runs on the CPU (use gloo)")
        return Transport(backend=None, link_device=device, description="gloo")
    shared = shares_device(device, env)
    why = " (asked for)"
    if want is None:
        flag = torch.tensor([int(shared)], dtype=torch.int64)
        if layout.world > 1 and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # CPU tensor: the default group's gloo
        want = "gloo" if flag.item() else "nccl"
        why = f" (processes share {device})" if shared else " (some process of the job shares its GPU)"
    if want == "gloo":
        return Transport(backend="gloo", link_device=torch.device("cpu"),
                         description="gloo, CUDA tensors staged through pinned host memory" + why)
    if layout.world > 1 and "nccl" not in str(dist.get_backend_config()):
        raise ValueError(
            f"comm_backend nccl, but the default process group was created with {dist.get_backend_config()}: "
            "create it with backend 'cpu:gloo,cuda:nccl' (or let the engine create it), or use gloo"
        )
    return Transport(backend=None, link_device=device, description="nccl")
