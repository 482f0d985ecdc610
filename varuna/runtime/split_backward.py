"""A stage's backward split into B (input gradient) and W (weight gradients), for the zero-bubble
schedules (``varuna/core/zero_bubble.py``).

:func:`backward_input` (B) back-propagates only along the paths that reach the stage's inputs,
keeping the graph, and on the way captures the gradient arriving at every *boundary node*: a
node on those paths with an edge into the weight-only part of the graph (the nodes that lead to
parameters and not to an input). :func:`backward_weight` (W) later re-enters the graph at the
boundary nodes with the captured gradients: one ``torch.autograd.grad`` per boundary node
computes the gradients flowing into its weight-only edges -- built-in nodes compute only the
outputs a graph task needs, so an ``addmm`` now computes just its weight gradient, the matmul B
skipped -- and one final ``torch.autograd.backward`` from all those edges accumulates into the
parameters' ``.grad`` with autograd's own AccumulateGrad, as a whole backward would. Outputs
that reach no input at all (the first stage's, whose input is data) are W's roots directly.

Note [Split backward soundness]: re-entering at a boundary node N computes, for each input of a
``torch.autograd.grad`` call, every path from N to it. If a weight-only entry M of N were also
reachable from another node (an x-path node after N, or another entry), that path's gradient
would be counted twice -- once in N's call and once in the other's. So the split is used only
when every entry has exactly one incoming edge in the graph (then its only path from any root
runs through N's direct edge); otherwise (a parameter used twice within the stage, say) W falls
back to one plain backward over the whole retained graph restricted to the parameters -- the
same gradients, with the input-gradient half computed a second time. :attr:`WeightWork.split`
says which happened. The captured gradient of N equals the one a whole backward gives it: every
consumer of N's outputs reaches the inputs through N, so B runs all of them.

Example::

    >>> lin = torch.nn.Linear(2, 2)
    >>> x = torch.ones(1, 2, requires_grad=True)
    >>> out = lin(x)
    >>> (gx,), work = backward_input([out], [torch.ones(1, 2)], [x])
    >>> lin.weight.grad is None        # B computed the input gradient only
    True
    >>> backward_weight(work); lin.weight.grad.tolist()
    [[1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightWork", "backward_input", "backward_weight"]


@dataclass
class WeightWork:
    """What W needs of one micro-batch's B (the graph stays alive through these references)."""

    boundary: list[tuple[object, tuple, list[tuple[object, int]]]] = field(default_factory=list)
    """(node, its captured grad_outputs, its weight-only entry edges (node, input_nr))."""
    roots: list[torch.Tensor] = field(default_factory=list)
    """Outputs that reach no input, and their gradients (``root_grads``): W starts there too."""
    root_grads: list[torch.Tensor | None] = field(default_factory=list)
    split: bool = True
    """False: Note [Split backward soundness] forbade the split; W redoes the whole backward."""
    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    """The leaves the outputs reach that are not inputs (for the fallback)."""


def _graph(roots: Sequence[object]) -> tuple[list[object], dict[object, int]]:
    """Every node reachable from ``roots`` (topological order: a node before what it leads to)
    and each node's number of incoming edges."""
    indeg: dict[object, int] = {}
    seen: set = set()
    order: list[object] = []
    stack = [(n, False) for n in roots if n is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for nxt, _ in node.next_functions:
            if nxt is not None:
                indeg[nxt] = indeg.get(nxt, 0) + 1
                if nxt not in seen:
                    stack.append((nxt, False))
    order.reverse()  # post-order reversed: parents before children
    for r in roots:
        if r is not None:
            indeg.setdefault(r, 0)
    return order, indeg


def _reaching(order: list[object], targets: set) -> set:
    """Nodes of ``order`` from which some node of ``targets`` is reachable (targets included)."""
    out = set()
    for node in reversed(order):  # children first
        if node in targets or any(n is not None and n in out for n, _ in node.next_functions):
            out.add(node)
    return out


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of ``inputs`` (None where an input is unused), and what W needs.

    ``outputs``/``grads`` as ``torch.autograd.backward`` takes them; ``inputs`` are leaves that
    require grad (the stage's received activations). Parameter ``.grad`` is not touched.
    """
    work = WeightWork(outputs=list(outputs), grads=list(grads))
    roots = [o.grad_fn for o in outputs]
    order, indeg = _graph(roots)
    in_targets = {get_gradient_edge(x).node for x in inputs}
    to_input = _reaching(order, in_targets)
    leaves = {n for n in order if not any(m is not None for m, _ in n.next_functions)}
    params = {n for n in leaves if n not in in_targets}
    to_param = _reaching(order, params)
    work.params = [n.variable for n in params if hasattr(n, "variable")]
    on_x = [(o, g) for o, g in zip(outputs, grads) if o.grad_fn in to_input]
    work.roots = [o for o in outputs if o.grad_fn not in to_input]
    work.root_grads = [g for o, g in zip(outputs, grads) if o.grad_fn not in to_input]
    captured: dict[object, tuple] = {}
    hooks = []
    for node in order:
        if node not in to_input:
            continue
        entries = [
            (m, nr) for m, nr in node.next_functions if m is not None and m in to_param and m not in to_input
        ]
        if not entries:
            continue
        if any(indeg.get(m, 0) != 1 for m, _ in entries):
            work.split = False
        work.boundary.append((node, (), entries))
        hooks.append(node.register_prehook(_capture(captured, node)))
    try:
        if on_x:
            got = torch.autograd.grad(
                [o for o, _ in on_x], list(inputs), [g for _, g in on_x], retain_graph=True, allow_unused=True
            )
        else:
            got = tuple(None for _ in inputs)
    finally:
        for h in hooks:
            h.remove()
    work.boundary = [(n, captured.get(n, ()), e) for n, _, e in work.boundary]
    return list(got), work


def _capture(store: dict, node: object):
    def hook(grad_outputs):
        store[node] = tuple(grad_outputs)

    return hook


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameter gradients of the micro-batch whose B produced ``work``."""
    if not work.split:
        if work.params:
            torch.autograd.backward(work.outputs, work.grads, inputs=work.params)
        return
    edges: dict[tuple[object, int], torch.Tensor] = {}
    for node, gos, entries in work.boundary:
        idx = [j for j, g in enumerate(gos) if g is not None]
        if not idx:
            continue
        targets = [GradientEdge(m, nr) for m, nr in entries]
        got = torch.autograd.grad(
            [GradientEdge(node, j) for j in idx], targets, [gos[j] for j in idx],
            retain_graph=True, allow_unused=True,
        )
        for (m, nr), g in zip(entries, got):
            if g is not None:
                key = (m, nr)
                edges[key] = edges[key] + g if key in edges else g
    roots: list = [GradientEdge(m, nr) for m, nr in edges] + list(work.roots)
    gs: list = list(edges.values()) + list(work.root_grads)
    if roots:
        torch.autograd.backward(roots, gs)
