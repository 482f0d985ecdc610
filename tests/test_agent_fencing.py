"""Note [Fencing under the manager] (manager/agent/vm_agent.py, the rule in manager/agent/fencing.py):
an agent whose manager stopped answering probes the manager's host after S; no answer there means
the VM is cut off and its workers are killed at once; an answer (a slow manager) keeps the old
T + 2 s bound. The rule on a fake clock, then the agent's loop with a fake gRPC client."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from manager.agent import vm_agent
from manager.agent.fencing import PROBE_SLACK_S, FenceRule
from manager.common.reachability import ANSWERED, SILENT, Prober, ProbeResult

S_S, FENCE_S = 3.0, 17.0


class FakeProber:
    timeout_s = 1.0

    def __init__(self, outcome: str) -> None:
        self.outcome, self.now, self.started = outcome, 0.0, []
        self._result: ProbeResult | None = None

    def probe(self, host, port) -> bool:
        self.started.append((host, port, self.now))
        self._result = ProbeResult(outcome=self.outcome, started=self.now, elapsed_s=0.0,
                                   detail="timed out after 1 s")
        return True

    def result(self, host, port):
        return self._result

    def in_flight(self, host, port) -> bool:
        return False


def _rule(outcome: str) -> tuple[FenceRule, FakeProber]:
    prober = FakeProber(outcome)
    return FenceRule(manager="10.0.0.1:7878", fence_timeout_s=FENCE_S, probe_after_s=S_S, prober=prober,
                     now=0.0), prober


def _reason_at(rule: FenceRule, prober: FakeProber, t: float):
    prober.now = t
    return rule.reason(t)


def test_no_answer_from_the_managers_host_fences_after_s():
    rule, prober = _rule(SILENT)
    assert _reason_at(rule, prober, S_S) is None and not prober.started, "not quiet long enough"
    t = S_S + PROBE_SLACK_S + 0.1
    assert _reason_at(rule, prober, t) is None, "the probe has just started"
    assert prober.started == [("10.0.0.1", 7878, t)]
    why = _reason_at(rule, prober, t + 0.05)
    assert why.startswith("no answer from the manager for "), why
    assert "its host 10.0.0.1:7878 does not answer" in why, why


def test_an_answering_host_keeps_the_old_bound():
    """Negative control: the manager's host answers (the manager is slow): no fence before T + 2."""
    rule, prober = _rule(ANSWERED)
    for t in (4.0, 4.1, 6.0, 10.0, FENCE_S - 0.1):
        assert _reason_at(rule, prober, t) is None
    assert len(prober.started) >= 3, "probed again while it stays quiet"
    assert _reason_at(rule, prober, FENCE_S + 0.1) == "no answer from the manager for 17.1 s and no refusal"


def test_a_stale_verdict_from_before_the_last_answer_is_not_used():
    rule, prober = _rule(SILENT)
    _reason_at(rule, prober, 4.0)  # probe: silent
    rule.answered(4.5)  # ... but the manager answered since (a blip)
    assert _reason_at(rule, prober, 5.0) is None
    assert _reason_at(rule, prober, 8.1) is None, "a new probe first"
    assert _reason_at(rule, prober, 8.2) is not None


def test_a_refusal_counts_as_hearing_from_the_manager():
    rule, prober = _rule(SILENT)
    rule.refused(10.0)  # the manager restarts: its host resets the connection
    assert _reason_at(rule, prober, 12.0) is None and not prober.started


class _Unanswered(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


class _SilentClient:
    """The agent's gRPC client, cut off: every heartbeat times out (at once: no real wait)."""

    def __init__(self, agent, done) -> None:
        self.agent, self.done, self.calls = agent, done, 0

    def vm_heartbeat(self, request, timeout_s):
        self.calls += 1
        if self.done() or self.calls > 200:  # 200 beats 0.1 s apart: far past the bound
            self.agent.request_shutdown()
        raise _Unanswered()

    def close(self) -> None:
        pass


def _agent(tmp_path, manager: str, prober: Prober) -> tuple[vm_agent.VMAgent, list]:
    token = tmp_path / "token"
    token.write_text("x" * 32)
    token.chmod(0o600)
    agent = vm_agent.VMAgent(vm_agent.AgentConfig(
        manager=manager, token_file=str(token), vm_id="v", log_dir=str(tmp_path), heartbeat_interval_s=0.1,
        fence_timeout_s=60.0, silence_probe_after_s=0.1))
    agent._prober.close()
    agent._prober = prober
    kills: list[str] = []
    agent._pool.kill_all = lambda: kills.append("kill")
    return agent, kills


def test_the_agent_fences_at_once_when_the_managers_host_is_silent(tmp_path, capsys):
    def cut_off(address, port, timeout_s):
        raise TimeoutError

    prober = Prober(timeout_s=0.5, clock=time.monotonic, connect=cut_off)
    agent, kills = _agent(tmp_path, "10.255.0.1:7878", prober)
    client = agent._client = _SilentClient(agent, lambda: bool(kills))
    try:
        assert agent._loop() == 0
    finally:
        prober.close()
    assert kills, f"not fenced after {client.calls} unanswered heartbeats"
    err = capsys.readouterr().err
    assert "its host 10.255.0.1:7878 does not answer (TCP probe timed out after 0.5 s): this VM is cut off;" \
           " fencing: killing its workers" in err, err


@pytest.mark.parametrize("listening", [True, False])
def test_the_agent_keeps_its_workers_while_the_managers_host_answers(tmp_path, capsys, listening):
    """Negative control: the manager's port accepts (a hung or slow manager), or its host resets
    the connection: the probes answer, the workers live on (until T + 2 s, far away here)."""
    with socket.socket() as s:
        if listening:
            s.bind(("127.0.0.1", 0))
            s.listen()
        else:
            s.bind(("127.0.0.1", 0))  # bound, not listening: the kernel resets a connect
        port = s.getsockname()[1]
        prober = Prober(timeout_s=0.2, clock=time.monotonic)
        started = []
        real_probe = prober.probe
        prober.probe = lambda h, p: started.append(p) or real_probe(h, p)

        def answered_twice() -> bool:
            result = prober.result("127.0.0.1", port)
            return len(started) >= 3 and result is not None and result.outcome == ANSWERED

        agent, kills = _agent(tmp_path, f"127.0.0.1:{port}", prober)
        agent._client = _SilentClient(agent, answered_twice)
        try:
            agent._loop()
        finally:
            prober.close()
    assert answered_twice() and not kills, capsys.readouterr().err
