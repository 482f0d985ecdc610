"""A quiet VM confirmed silent by a probe of its host (Note [Silence probes]), so the manager names
it within seconds while T (``--heartbeat-timeout``) stays long enough for a busy VM.

Note [Silence probes]: a VM whose agent has not heartbeated for S (``--silence-probe-after``,
default 1.5 heartbeat intervals: one beat late) is probed: one TCP connect to its address on the
free port it last reported (closed there, so a live kernel resets it; a port that has since
become a listening one accepts: an answer too; Note [Reachability probe] in
manager/common/reachability.py). The connect runs on the prober's threads: a tick only starts
probes and reads finished ones, it never waits. The verdict:

- *silent* (no answer within the probe timeout P, or no route): the VM is gone now, its reason
  ``no heartbeat for 4.2 s and its host does not answer (TCP probe timed out after 1 s)``;
- *answered*: the host is there, only its agent is late (starved, swapping, a loaded VM): nothing
  happens, T still applies; it is probed again while it stays quiet;
- no verdict yet, or one from before its last heartbeat: probe (again).

Baseline: the fast path is enabled for a VM only after one probe of it *answered* (each VM is
probed once when it has reported a free port), so a network that drops SYNs to closed ports (a
firewall) never makes a live VM look silent: such a VM is declared gone after T, as before.

Detection of a silent VM is then at most S + P + two ticks after its last heartbeat (about
3 + 1 + 0.4 s with the defaults: within 5 s), or T when its baseline never answered. A partition
shorter than that which hides a VM's heartbeats and its kernel loses the VM (it comes back with
``vm-back`` and is used again), where T alone would have waited it out.

    >>> SilenceProbes.__name__
    'SilenceProbes'
"""

from __future__ import annotations

from manager.common.reachability import ANSWERED, silent_since
from manager.domain.context import ManagerContext
from manager.domain.records import VMRecord

__all__ = ["BASELINE_RETRY_S", "SilenceProbes"]

#: A VM whose baseline probe did not answer is probed for it again after this long (once a minute
#: costs nothing, and a blip at registration does not disable its fast path for good).
BASELINE_RETRY_S = 60.0


class SilenceProbes:
    """Note [Silence probes]: :meth:`verdict` says why a quiet VM is gone, or None.

    Example::

        probes = SilenceProbes(ctx)          # ctx.reach is the prober (manager/domain/ports.py)
        why = probes.verdict(vm, age_s, now)  # each tick, for every VM that is up
        if why: book.mark_gone(job, vm, why, now, silent_s=age_s)
    """

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx
        self._baseline: dict[str, str] = {}
        """vm_id -> the address whose probe answered (the fast path is on for that address)."""
        self._baseline_asked: dict[str, tuple[str, int, float]] = {}
        """vm_id -> (address, port, when) of its pending or failed baseline probe."""

    def verdict(self, vm: VMRecord, age_s: float, now: float) -> str | None:
        """Why ``vm`` (up, quiet for ``age_s``) is gone now, or None (not silent, or not yet known)."""
        after_s = self.ctx.config.silence_probe_after_s
        if after_s <= 0 or vm.state != "up" or not vm.address or vm.free_port <= 0:
            return None
        if self._baseline.get(vm.vm_id) != vm.address:
            self._ask_baseline(vm, now)
            return None
        if age_s <= after_s:
            return None
        # Probe again when none began after its last heartbeat (or the restart grace: Note [Restart
        # grace]), or the latest answer is getting old (the host may have gone silent since).
        result, _ = silent_since(self.ctx.reach, vm.address, vm.free_port, since=now - age_s, now=now,
                                 timeout_s=self.ctx.config.probe_timeout_s)
        if result is not None:
            return (f"no heartbeat for {age_s:.1f} s and its host does not answer "
                    f"(TCP probe {result.detail})")
        return None

    def _ask_baseline(self, vm: VMRecord, now: float) -> None:
        asked = self._baseline_asked.get(vm.vm_id)
        if asked is not None and asked[0] == vm.address:
            address, port, when = asked
            result = self.ctx.reach.result(address, port)
            if result is not None and result.outcome == ANSWERED and result.started >= when:
                self._baseline[vm.vm_id] = address
                del self._baseline_asked[vm.vm_id]
                return
            if now - when < BASELINE_RETRY_S:
                return
        self._baseline_asked[vm.vm_id] = (vm.address, vm.free_port, now)
        self.ctx.reach.probe(vm.address, vm.free_port)
