"""Reference derivation of the varuna task lists by simulating the paper's rules.

``varuna.core.schedule`` builds the lists in closed form; this module derives them the long way, as
Note [Varuna schedule] describes -- an event-driven simulation of rules (1)-(3) with unit costs
F=1, R=1, B=2 and instantaneous communication, iterated to a fixed point -- so the tests can check
that the closed form is what the rules produce.
"""

from __future__ import annotations

import heapq
import math

from varuna.core.tasks import BACKWARD, FORWARD, RECOMPUTE, Task

_UNIT_F, _UNIT_R, _UNIT_B = 1, 1, 2


def varuna_by_rules(num_stages: int, num_microbatches: int) -> tuple[tuple[Task, ...], ...]:
    """Per stage, the varuna list that simulating the rules yields."""
    if num_stages == 1:
        # A single stage is the last stage: it never recomputes.
        return (tuple(t for i in range(num_microbatches) for t in (Task(FORWARD, i), Task(BACKWARD, i))),)
    inf = math.inf
    est = [[inf] * num_microbatches for _ in range(num_stages)]
    seen: list[tuple[tuple[int, ...], ...]] = []
    orders: tuple[tuple[int, ...], ...] = ()
    for _ in range(64):
        orders, arrivals = _varuna_pass(num_stages, num_microbatches, est)
        if orders in seen:
            # Fixed point (or a short cycle, which we break deterministically by taking the
            # first order of the cycle that was found).
            break
        seen.append(orders)
        est = arrivals
    else:
        orders = seen[-1]
    # Passes work on integer task codes (3·i + op); one Task object per code, shared by stages.
    table = [Task(op, i) for i in range(num_microbatches) for op in (FORWARD, RECOMPUTE, BACKWARD)]
    return tuple(tuple(table[c] for c in o) for o in orders)


def _varuna_pass(P: int, N: int, est: list[list[float]]):
    """One event-driven pass with unit costs; returns (orders, observed gradient arrivals).

    Orders are tuples of task codes 3·i + {F: 0, R: 1, B: 2}. The decision rules are those of
    Note [Varuna schedule], inlined in the loop because the varuna lists of a large pipeline
    (P=36, Nm=228: 25k tasks, two passes) are built on the simulator's critical path.
    """
    inf = math.inf
    unit_f, unit_r, unit_b = _UNIT_F, _UNIT_R, _UNIT_B
    act_arrival = [[inf] * N for _ in range(P)]  # when F_i's input is available on stage k
    grad_arrival = [[inf] * N for _ in range(P)]  # when B_i's gradient is available on stage k
    for i in range(N):
        act_arrival[0][i] = 0
    orders: list[list[int]] = [[] for _ in range(P)]
    next_f = [0] * P
    next_r = [0] * P  # next micro-batch to recompute (increasing order)
    pending_b: list[int | None] = [None] * P  # rule (2): micro-batch recomputed and awaiting its backward
    last_fwd_done: list[int | None] = [None] * P  # last stage: F_i done, B_i due
    done_b = [0] * P
    heap = [(0, k) for k in range(P)]
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    wake_at = [0.0] * P
    last = P - 1
    while heap:
        t, k = pop(heap)
        if t < wake_at[k] or done_b[k] == N:
            continue
        # -- decide: op (0 F, 1 R, 2 B) on micro-batch i, or wait until `wait` --------------
        op = -1
        wait = inf
        if k == last:
            i = last_fwd_done[k]
            if i is not None:
                op = 2
            else:
                f = next_f[k]
                if f < N:
                    if act_arrival[k][f] <= t:
                        op, i = 0, f
                    else:
                        wait = act_arrival[k][f]
        elif pending_b[k] is not None:  # rule (2)
            i = pending_b[k]
            if grad_arrival[k][i] <= t:
                op = 2
            else:
                wait = grad_arrival[k][i]
        else:
            nf = next_f[k]
            f = nf if nf < N else -1
            f_ready = f >= 0 and act_arrival[k][f] <= t
            j = next_r[k] if next_r[k] < nf else -1
            if j >= 0:
                g = grad_arrival[k][j]
                arrival = g if g < inf else est[k][j]
            if f_ready and (j < 0 or t + unit_f + unit_r <= arrival):
                op, i = 0, f
            elif j >= 0:
                if g <= t or t + unit_r >= arrival:
                    op, i = 1, j
                else:
                    wait = arrival - unit_r
                    if f >= 0 and not f_ready:
                        wait = min(wait, act_arrival[k][f])
            elif f >= 0:
                wait = act_arrival[k][f]
        if op < 0:
            if wait < inf:
                wake_at[k] = wait
                push(heap, (wait, k))
            else:
                wake_at[k] = inf  # woken by an arrival below
            continue
        # -- run it -----------------------------------------------------------------------
        orders[k].append(3 * i + op)
        if op == 0:
            end = t + unit_f
            next_f[k] += 1
            if k == last:
                last_fwd_done[k] = i
            else:
                act_arrival[k + 1][i] = end
                if wake_at[k + 1] > end:
                    wake_at[k + 1] = end
                    push(heap, (end, k + 1))
        elif op == 1:
            end = t + unit_r
            next_r[k] += 1
            pending_b[k] = i
        else:
            end = t + unit_b
            done_b[k] += 1
            pending_b[k] = None
            last_fwd_done[k] = None
            if k > 0:
                grad_arrival[k - 1][i] = end
                if wake_at[k - 1] > end:
                    wake_at[k - 1] = end
                    push(heap, (end, k - 1))
        wake_at[k] = end
        push(heap, (end, k))
    return tuple(tuple(o) for o in orders), grad_arrival
