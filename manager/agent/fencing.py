"""When an agent must kill its workers because its VM is cut off from the manager (Note [Fencing
under the manager] in manager/agent/vm_agent.py): the rule, apart from the agent's loop and its
gRPC client, so that it is tested on a fake clock with a fake prober.

    >>> rule = FenceRule(manager="10.0.0.1:7878", fence_timeout_s=17.0, probe_after_s=0.0, now=0.0)
    >>> rule.reason(10.0) is None, rule.reason(17.5)
    (True, 'no answer from the manager for 17.5 s and no refusal')
"""

from __future__ import annotations

from manager.common.reachability import Prober, silent_since

__all__ = ["PROBE_SLACK_S", "FenceRule", "manager_target"]

#: An agent probes its manager this long after the manager's S without an answer: an answer is
#: due every heartbeat interval (S is 1.5 of them), the slack covers a reply slowed by load.
PROBE_SLACK_S = 0.5


def manager_target(manager: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` manager address; None for what cannot be probed (a Unix
    socket, no port).

    >>> manager_target("10.0.0.1:7878"), manager_target("[::1]:7878"), manager_target("unix:/tmp/m.sock")
    (('10.0.0.1', 7878), ('::1', 7878), None)
    """
    host, _, port = manager.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or host == "unix" or host.startswith("unix:"):
        return None
    return host, int(port)


class FenceRule:
    """Whether to fence now. Two bounds on how long a cut-off VM's workers live:

    - ``probe_after_s`` S (+ :data:`PROBE_SLACK_S`) without an answer, and the manager's host does
      not answer a TCP connect within the prober's timeout: cut off, fence now;
    - ``fence_timeout_s`` (T + 2 s) with neither an answer nor a refusal: fence (the manager's
      host answered the probes, yet the manager never did: it is hung or overloaded).

    A refusal (the manager restarting) counts as hearing from it, as an answer does.

    Example::

        rule = FenceRule(manager="10.0.0.1:7878", fence_timeout_s=17.0, probe_after_s=3.0,
                         prober=Prober(timeout_s=1.0, clock=time.monotonic), now=time.monotonic())
        rule.answered(now)          # after each answered heartbeat
        why = rule.reason(now)      # each pass of the loop: a reason to fence, or None
    """

    def __init__(
        self,
        *,
        manager: str,
        fence_timeout_s: float,
        probe_after_s: float,
        now: float,
        prober: Prober | None = None,
    ) -> None:
        self.fence_timeout_s = fence_timeout_s
        self.probe_after_s = probe_after_s
        self._target = manager_target(manager) if probe_after_s > 0 and prober is not None else None
        self._prober = prober
        self.last_ok = now
        """When the manager last answered."""
        self.last_heard = now
        """When the manager (or its host, refusing) last answered."""
        self._probe_due: float | None = None

    def answered(self, now: float) -> None:
        """A heartbeat was answered."""
        self.last_ok = self.last_heard = now
        self._probe_due = None

    def refused(self, now: float) -> None:
        """A heartbeat was refused (the manager's host is there, its manager is not)."""
        self.last_heard = now

    def reason(self, now: float) -> str | None:
        """Why this VM is cut off now, or None; starts a probe when one is due (never blocks)."""
        quiet = now - self.last_heard
        if self.fence_timeout_s > 0 and quiet > self.fence_timeout_s:
            return f"no answer from the manager for {quiet:.1f} s and no refusal"
        if self._target is None or self._prober is None or quiet <= self.probe_after_s + PROBE_SLACK_S:
            return None
        host, port = self._target
        result, started = silent_since(self._prober, host, port, since=self.last_heard, now=now,
                                       timeout_s=self._prober.timeout_s)
        if result is not None:
            return (f"no answer from the manager for {quiet:.1f} s and its host {host}:{port} does not "
                    f"answer (TCP probe {result.detail})")
        if started:
            self._probe_due = now + self._prober.timeout_s
        return None

    def rpc_timeout(self, now: float, timeout_s: float) -> float:
        """How long the next heartbeat may wait while the manager does not answer: never past the
        fence, nor much past a probe's verdict (the loop must read it)."""
        ends = [timeout_s]
        if self.fence_timeout_s > 0:
            ends.append(self.last_heard + self.fence_timeout_s - now + 0.05)
        if self._probe_due is not None and self._target is not None and self._prober is not None \
                and self._prober.in_flight(*self._target):
            ends.append(self._probe_due - now + 0.05)
        return max(0.2, min(ends))
