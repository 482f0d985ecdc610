"""Emulated devices: model layers that *take the time* of an accelerator without using the CPU.

Schedule experiments need many pipeline stages, but development machines have 2 cores. An
:class:`EmulatedBlock` stands in for a block of a real model: its forward sleeps ``fwd_s`` and its
backward sleeps ``bwd_factor * fwd_s``, around a tiny real op (``x * scale + bias``, elementwise,
shape preserving) so autograd flows and gradients can be checked exactly. ``time.sleep`` releases
the GIL and burns no CPU, like a process waiting on its accelerator, so dozens of emulated stages
fit on 2 cores and the wall-clock behaviour of a schedule (bubbles, overlap with communication)
is what the real hardware would show for those per-block costs.

Used by tests, the simulator's validation runs and the benchmark scripts; together with
:mod:`varuna.testing.netem` (emulated network) it gives an emulated cluster on one machine.

Example::

    >>> import torch
    >>> block = EmulatedBlock(fwd_s=0.01, width=4)        # 10 ms forward, 20 ms backward
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> block(x).sum().backward()
    >>> (block.num_forward, block.num_backward, tuple(x.grad.shape))
    (1, 1, (2, 4))

What it models: per-block compute time (forward, backward, and recompute, which re-runs the
forward and so sleeps ``fwd_s`` again) and activation memory (the input is saved for backward,
as a real block saves its activations). What it does not model: FLOPs, memory bandwidth, kernel
launch overheads, contention between processes sharing one real device, or the real numerics of
the model being stood in for. On ``meta`` tensors (shape inference, placeholders) it does not
sleep: no device work happens there.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EmulatedBlock", "EmulatedModel", "emulated_model"]


class _EmulatedOp(torch.autograd.Function):
    """The input half ``x * scale`` (``scale`` detached): the forward sleeps ``block.fwd_s``, the
    backward (the input gradient) ``(1 - weight_frac) * block.bwd_s``.

    Note [Emulated split backward]: a block's output is the sum of two autograd nodes, this one
    and :class:`_EmulatedWeightOp` (the bias, broadcast, whose backward computes the parameter
    gradients and takes the other ``weight_frac`` of the backward time): ``x * scale + bias``,
    the same values and gradients as one op. A whole backward runs both (the same time); a
    zero-bubble B (the gradient w.r.t. the input only) runs this one, its W the other -- as a
    real layer's backward computes only the outputs that are asked for.
    """

    # The classic ``forward(ctx, ...)`` form on purpose: with a separate ``setup_context``, every
    # ``apply`` binds default arguments through ``inspect.signature`` (~0.1 ms of CPU per call on
    # a busy 2-core host), which would make the emulated device slower than its nominal time.
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, block: EmulatedBlock) -> torch.Tensor:
        if not x.is_meta:
            block.num_forward += 1
            if block.fwd_s > 0:
                time.sleep(block.fwd_s)  # releases the GIL: an accelerator busy, not the CPU
        ctx.block = block
        ctx.save_for_backward(scale)
        return x * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        (scale,) = ctx.saved_tensors
        block: EmulatedBlock = ctx.block
        shared = getattr(ctx, "shared", {})
        if shared.pop("slept", False):
            pass  # a whole backward: the weight half slept for both (one sleep: less overshoot)
        elif not grad_out.is_meta and block.bwd_s > 0:
            shared["input_ran"] = True
            time.sleep((1.0 - block.weight_frac) * block.bwd_s)
        return grad_out * scale, None, None


class _EmulatedWeightOp(torch.autograd.Function):
    """``bias`` broadcast to the output's shape, whose backward computes the gradients of
    ``scale`` (from the saved input ``x``, detached) and ``bias``, sleeping ``weight_frac *
    block.bwd_s`` -- all of ``block.bwd_s`` when the input needs no gradient (then the input
    half has no backward). Not on the input's path, so a B never runs it (Note [Emulated split
    backward])."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, block: EmulatedBlock, whole: bool
    ) -> torch.Tensor:
        ctx.block = block
        ctx.bias_shape = bias.shape
        ctx.whole = whole
        # Saving the input keeps one activation alive until backward, as a real block would.
        ctx.save_for_backward(x, scale)
        return bias.expand(x.shape).clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        x, scale = ctx.saved_tensors
        block: EmulatedBlock = ctx.block
        if not grad_out.is_meta:
            block.num_backward += 1
            if block.bwd_s > 0:
                time.sleep(block.weight_frac * block.bwd_s if not _sleeps_whole(ctx) else block.bwd_s)
        # sum_to_size undoes the broadcasting of the (width,) parameters over the batch dims.
        grad_scale = (grad_out * x).sum_to_size(scale.shape) if ctx.needs_input_grad[1] else None
        grad_bias = grad_out.sum_to_size(ctx.bias_shape) if ctx.needs_input_grad[2] else None
        return None, grad_scale, grad_bias, None, None


def _sleeps_whole(ctx: Any) -> bool:
    """Whether the weight half takes the whole backward's time: when the input half has no
    backward, or will run in this same backward after this one (then it skips its sleep)."""
    if ctx.whole:
        return True
    shared, node = getattr(ctx, "shared", None), getattr(ctx, "input_node", None)
    if shared is None or node is None or shared.pop("input_ran", False):
        return False
    if torch._C._will_engine_execute_node(node):
        shared["slept"] = True
        return True
    return False


class EmulatedBlock(nn.Module):
    """A model block that takes ``fwd_s`` forward and ``bwd_factor * fwd_s`` backward (sleeping).

    The real computation is ``x * scale + bias`` over the last dimension (``width``), so the
    output has the input's shape and gradients for ``x``, ``scale`` and ``bias`` are exact.
    ``num_forward`` / ``num_backward`` count calls (recompute shows up as an extra forward);
    :meth:`reset_counts` zeroes them.

    Example::

        >>> block = EmulatedBlock(fwd_s=0.0, width=3)
        >>> block(torch.ones(5, 3)).shape
        torch.Size([5, 3])
    """

    def __init__(
        self, fwd_s: float, width: int, *, bwd_factor: float = 2.0,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
        weight_frac: float = 0.5,
    ) -> None:
        super().__init__()
        if not 0.0 <= weight_frac <= 1.0:
            raise ValueError(f"weight_frac must lie in [0, 1], got {weight_frac!r}")
        #: the share of the backward spent on the parameter gradients (Note [Emulated split backward])
        self.weight_frac = float(weight_frac)
        if not (math.isfinite(fwd_s) and fwd_s >= 0):
            raise ValueError(f"fwd_s must be a finite number of seconds >= 0, got {fwd_s!r}")
        if not (math.isfinite(bwd_factor) and bwd_factor >= 0):
            raise ValueError(f"bwd_factor must be >= 0, got {bwd_factor!r}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.fwd_s = float(fwd_s)
        self.bwd_factor = float(bwd_factor)
        self.width = width
        self.scale = nn.Parameter(torch.empty(width, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(width, device=device, dtype=dtype))
        self.num_forward = 0
        self.num_backward = 0
        self.reset_parameters()

    @property
    def bwd_s(self) -> float:
        """Backward time in seconds: ``bwd_factor * fwd_s``."""
        return self.bwd_factor * self.fwd_s

    def reset_parameters(self) -> None:
        """Scale near 1 and bias near 0 (global RNG, like ``nn.Linear``): activations stay O(1)
        through many blocks while every block still gets a distinct, non-trivial gradient."""
        with torch.no_grad():
            nn.init.uniform_(self.scale, 0.9, 1.1)
            nn.init.uniform_(self.bias, -0.1, 0.1)

    def reset_counts(self) -> None:
        self.num_forward = 0
        self.num_backward = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != (self.width,):
            raise ValueError(f"EmulatedBlock(width={self.width}) got an input of shape {tuple(x.shape)}; "
                             f"the last dimension must be {self.width}")
        xs = _EmulatedOp.apply(x, self.scale.detach(), self)
        w = _EmulatedWeightOp.apply(x.detach(), self.scale, self.bias, self, not x.requires_grad)
        if xs.grad_fn is not None and w.grad_fn is not None:
            xs.grad_fn.shared = w.grad_fn.shared = {}  # per call (Note [Emulated split backward])
            w.grad_fn.input_node = xs.grad_fn
        return xs + w

    def extra_repr(self) -> str:
        return f"fwd_s={self.fwd_s}, bwd_s={self.bwd_s}, width={self.width}"


class EmulatedModel(nn.Module):
    """``blocks[0] → cut → blocks[1] → cut → … → blocks[-1]``, then the MSE loss against ``target``.

    ``forward(x, target)`` returns the scalar loss, so the model can be trained directly or handed
    to the engine. Build it with :func:`emulated_model`.
    """

    def __init__(self, blocks: Sequence[EmulatedBlock], cut_points: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(cut_points) != max(0, len(blocks) - 1):
            raise ValueError(f"need one cut point between consecutive blocks: {len(blocks)} blocks, "
                             f"{len(cut_points)} cut points")
        self.blocks = nn.ModuleList(blocks)
        self.cut_points = nn.ModuleList(cut_points)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index < len(self.cut_points):
                x = self.cut_points[index](x)
        return F.mse_loss(x, target)

    def reset_counts(self) -> None:
        for block in self.blocks:
            block.reset_counts()


def emulated_model(
    num_blocks: int, fwd_s: float | Sequence[float], width: int, *, bwd_factor: float = 2.0,
    device: torch.device | str | None = None, dtype: torch.dtype | None = None, speed: float = 1.0,
    weight_frac: float = 0.5,
) -> EmulatedModel:
    """A trainable model of ``num_blocks`` emulated blocks with a ``varuna.CutPoint`` between
    consecutive blocks: ``num_blocks - 1`` cut-points, so ``num_blocks`` segments of one block
    each (the last segment also computes the loss).

    ``fwd_s`` is one forward time for all blocks or one per block (e.g. a heavier first block).
    Inputs and targets have shape ``(batch, width)`` (or any ``(..., width)``). ``speed``: the
    emulated device's relative speed (mixed VM types, issue #19): every block takes
    ``fwd_s / speed`` (and its backward ``bwd_factor`` times that), so a process built with
    ``speed=1.6`` is a device 1.6× faster; the weights do not depend on it. ``weight_frac``: each
    block's share of the backward spent on weight gradients (``EmulatedBlock``).

    Example::

        >>> model = emulated_model(num_blocks=4, fwd_s=0.001, width=8)
        >>> loss = model(torch.randn(2, 8), torch.zeros(2, 8))
        >>> loss.backward()          # takes about 4 * (1 + 2) ms
    """
    # Imported here, not at module level: varuna.testing.emulated must import without the engine.
    from varuna.cutting.cutpoint import CutPoint

    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if not (isinstance(speed, (int, float)) and 0 < speed < math.inf):
        raise ValueError(f"speed must be a finite number > 0 (relative device speed), got {speed!r}")
    if isinstance(fwd_s, (int, float)):
        times = [float(fwd_s)] * num_blocks
    else:
        times = [float(t) for t in fwd_s]
        if len(times) != num_blocks:
            raise ValueError(f"fwd_s has {len(times)} entries for {num_blocks} blocks; give one "
                             f"number or one per block")
    blocks = [
        EmulatedBlock(t / speed, width, bwd_factor=bwd_factor, device=device, dtype=dtype,
                      weight_frac=weight_frac)
        for t in times
    ]
    return EmulatedModel(blocks, [CutPoint() for _ in range(num_blocks - 1)])


#: Runs ``script`` as ``python script args`` would, after asking the kernel to SIGKILL the worker
#: when the launching process dies (varuna.core.process): a benchmark stopped with SIGTERM or
#: SIGKILL leaves no rank running its remaining configurations.
_CHILD_BOOT = (
    "import os, runpy, sys\n"
    "from varuna.core.process import die_with_parent\n"
    "die_with_parent(int(sys.argv[1]))\n"
    "sys.argv = sys.argv[2:]\n"
    "sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def run_local_world(
    script: str, args: Sequence[str], world: int, out_dir: str | os.PathLike, timeout_s: float, *, what: str
) -> list[dict]:
    """Run ``script args`` as ``world`` gloo ranks on 127.0.0.1; return each rank's
    ``out_dir/rank{r}.json``. Benchmark/validation helper: ranks > 0 log to ``rank{r}.log``,
    every process is killed on timeout or failure or when this process dies, and ``$VARUNA_NETEM``
    is not inherited (the worker sets up its own emulation)."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    out = Path(out_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parent.parent)
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        env.pop("VARUNA_NETEM", None)
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        sink = None if rank == 0 else log
        procs.append((subprocess.Popen([sys.executable, "-c", _CHILD_BOOT, str(os.getpid()), script, *args],
                                       env=env, stdout=sink,
                                       stderr=subprocess.STDOUT if sink else None), log))
    deadline = time.monotonic() + timeout_s
    try:
        for p, _ in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} workers did not finish in {timeout_s:.0f} s; logs in {out}") from None
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            log.close()
    bad = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = (out / f"rank{bad[-1]}.log").read_text()[-3000:]
        raise RuntimeError(f"{what} worker(s) {bad} failed; rank {bad[-1]} log:\n{tail}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
