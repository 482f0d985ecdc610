"""A recomputed micro-batch run as a chain of blocks (Note [Selective recompute] in
varuna/core/selective_recompute.py): the forward keeps the graphs of the kept blocks and stashes
the inputs of the recomputed ones, R rebuilds those graphs, B walks the chain backwards.

Per micro-batch the chain is a list with one ``[inputs, out]`` per block (``None`` for a
recomputed block until its R); a recomputed block's stashed input is kept in
``_Work.chain_stash[(key, j)]``. The executor (varuna/runtime/executor.py) calls these three
functions for the micro-batches the schedule recomputes when the stage has a recompute set.

Example::

    out = forward_chain(executor, work, batch, mb, key, received, blocks)   # F
    recompute_chain(executor, work, batch, mb, key)                         # R
    upstream = backward_chain(executor, work, mb, key)                      # B
"""

from __future__ import annotations

import torch

from varuna.core.batching import MicroBatch

__all__ = ["forward_chain", "recompute_chain", "backward_chain", "leaf"]


def leaf(x: torch.Tensor) -> torch.Tensor:
    """A received activation as an autograd leaf that collects its gradient (floating point only)."""
    t = x.detach()
    if t.is_floating_point():
        t.requires_grad_(True)
    return t


def _leaves(xs):
    return None if xs is None else tuple(leaf(x) for x in xs)


def forward_chain(ex, work, batch, mb: MicroBatch, key: tuple[int, int], received, blocks) -> object:
    """F of a recomputed micro-batch block by block; returns the last block's output (the loss on
    the pipeline's last virtual stage, else the tensors to send)."""
    det_grad = ex.config.determinism.enabled  # Note [Deterministic forward]: a recompute's autograd state
    chain: list = []
    x = received
    out = None
    for j, blk in enumerate(blocks):
        with_grad = not blk.recompute or det_grad
        inputs = _leaves(x) if (x is not None and with_grad) else x
        out = ex._forward(batch, mb, inputs, with_grad=with_grad, chunk=key[1], block=blk)
        if blk.recompute:
            work.chain_stash[(key, j)] = x
            chain.append(None)
            if ex._verify and not blk.sink:
                work.chain_sent[(key, j)] = tuple(o.detach() for o in out)
        else:
            chain.append([inputs, out])
        if not blk.sink:
            x = tuple(o.detach() for o in out)  # storage shared with the graph that holds ``out``
    work.chains[key] = chain
    return out


def recompute_chain(ex, work, batch, mb: MicroBatch, key: tuple[int, int]) -> None:
    """R: rebuild the graph of every recomputed block from its stashed input."""
    chain = work.chains[key]
    for j, blk in enumerate(ex.s.blocks(key[1])):
        if not blk.recompute:
            continue
        inputs = _leaves(work.chain_stash.pop((key, j)))
        out = ex._forward(batch, mb, inputs, with_grad=True, chunk=key[1], block=blk)
        sent = work.chain_sent.pop((key, j), None)
        if sent is not None:
            ex._check_recompute(mb, sent, out, key[1], segments=(blk.first, blk.last))
        chain[j] = [inputs, out]


def backward_chain(ex, work, mb: MicroBatch, key: tuple[int, int], scale: float) -> tuple | None:
    """B: back-propagate every block, last first; returns the gradients of the stage's input (its
    floating-point tensors) to send upstream, None on the pipeline's first virtual stage."""
    chain = work.chains.pop(key)
    g = work.grads.pop(key, None)
    upstream = None
    for inputs, out in reversed(chain):
        if not isinstance(out, tuple):  # the loss
            pairs = [(out * scale, None)]
        else:
            floats = [o for o in out if o.is_floating_point()]
            pairs = [(o, gi) for o, gi in zip(floats, g) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [gi for _, gi in pairs])
        upstream = None if inputs is None else tuple(
            (x.grad if x.grad is not None else torch.zeros_like(x)) for x in inputs if x.is_floating_point()
        )
        g = upstream
    return upstream
