"""Note [Silence probes] (manager/domain/silence.py): a VM quiet for S whose host does not answer a
probe is gone at once, named with the reason; one whose host answers (a starved agent) and one
whose probes never answered (a firewall dropping SYNs) are gone only after T. The control loop
runs on a fake clock with a fake prober (tests/test_manager_controller.py's World); the real
prober's sockets are tests/test_reachability.py's."""

from __future__ import annotations

import sys
from pathlib import Path

from manager.common.reachability import ANSWERED, SILENT, ProbeResult

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_controller import FakeProvider, World  # noqa: E402

T_S = 3.0
S_S = 0.75


class FakeReach:
    """A prober whose connects finish at once, with the outcome the test set for the port."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.outcome: dict[int, str] = {}
        self.default = ANSWERED
        self.probes: list[tuple[str, int]] = []
        self._results: dict[tuple[str, int], ProbeResult] = {}

    def probe(self, address: str, port: int) -> bool:
        self.probes.append((address, port))
        outcome = self.outcome.get(port, self.default)
        detail = "timed out after 1 s" if outcome == SILENT else "refused"
        self._results[(address, port)] = ProbeResult(outcome=outcome, started=self.clock(), elapsed_s=0.0,
                                                     detail=detail)
        return True

    def result(self, address: str, port: int) -> ProbeResult | None:
        return self._results.get((address, port))

    def close(self) -> None:
        pass


def _running_world(tmp_path, *, firewalled: bool = False):
    w = World(tmp_path, provider=FakeProvider(capacity=4), heartbeat_timeout_s=T_S,
              silence_probe_after_s=S_S, probe_timeout_s=1.0)
    w.mgr.ctx.reach.close()  # the real prober the Manager made: replaced by the fake
    reach = w.mgr.ctx.reach = FakeReach(w.clock)
    if firewalled:
        reach.default = SILENT  # a network that drops SYNs to closed ports: no probe ever answers
    job = w.submit(max_vms=4)
    w.tick()
    for i, vm in enumerate(w.vms.values()):
        vm.port = 21000 + i  # one probe target per VM
    w.tick(0.1)
    w.steps(job, 1, 3)
    w.tick(2.0)  # past the manager's start grace (Note [Restart grace] in manager/domain/context.py)
    victim = w.running(job)[1]
    return w, reach, job, victim


def _quiet_for(w, seconds: float, dt: float = 0.25) -> None:
    for _ in range(round(seconds / dt)):
        w.tick(dt)


def test_a_quiet_vm_whose_host_does_not_answer_is_gone_after_s_plus_the_probe(tmp_path):
    w, reach, job, victim = _running_world(tmp_path)
    assert len(reach.probes) >= 4, "the baseline probe of each VM"
    rank = next(iter(victim.workers))
    victim.alive = False
    reach.outcome[victim.port] = SILENT
    _quiet_for(w, 1.5)
    [gone] = w.event(job, "vm-gone")
    assert gone.vm_id == victim.vm_id and gone.data["ranks"] == [rank]
    assert S_S < gone.data["silent_s"] < T_S, gone.data
    assert "and its host does not answer (TCP probe timed out after 1 s)" in gone.message, gone.message
    assert gone.message.startswith(f"{victim.vm_id} (rank {rank}): no heartbeat for "), gone.message
    w.until(lambda: w.event(job, "killing"))
    assert f"{victim.vm_id} (rank {rank}) gone (no heartbeat for" in w.event(job, "killing")[0].message


def test_a_quiet_vm_whose_host_answers_is_gone_only_after_t(tmp_path):
    """Negative control: a starved agent on a host whose kernel answers: T still applies."""
    w, reach, job, victim = _running_world(tmp_path)
    victim.alive = False
    _quiet_for(w, T_S - 0.5)
    assert not w.event(job, "vm-gone")
    probes = sum(p == ("127.0.0.1", victim.port) for p in reach.probes)
    assert probes >= 2, "probed again while it stays quiet"
    _quiet_for(w, 1.0)
    [gone] = w.event(job, "vm-gone")
    assert gone.data["silent_s"] > T_S and "does not answer" not in gone.message, gone.message


def test_no_fast_path_for_a_vm_whose_baseline_probe_never_answered(tmp_path):
    """Negative control: a firewall drops SYNs to closed ports (every probe looks silent): without
    an answered baseline the VM is gone only after T, never at S."""
    w, reach, job, victim = _running_world(tmp_path, firewalled=True)
    victim.alive = False
    _quiet_for(w, T_S - 0.5)
    assert not w.event(job, "vm-gone")
    _quiet_for(w, 1.0)
    [gone] = w.event(job, "vm-gone")
    assert gone.data["silent_s"] > T_S and "does not answer" not in gone.message, gone.message


def test_probes_off_is_t_alone(tmp_path):
    """``--silence-probe-after 0``: the manager makes no prober and waits T."""
    w = World(tmp_path, silence_probe_after_s=0.0)
    assert type(w.mgr.ctx.reach).__name__ == "NoReachability"


def test_the_cli_default_is_one_beat_late_and_a_bad_value_is_one_line(tmp_path, capsys):
    from manager.cli import _build_parser, _tuning, main

    base = ["serve", "--db", str(tmp_path / "s.sqlite"), "--token-file", str(tmp_path / "t")]
    tuning = _tuning(_build_parser().parse_args([*base, "--heartbeat-interval", "0.5"]))
    assert tuning["silence_probe_after_s"] == 0.75 and tuning["probe_timeout_s"] == 1.0
    off = _tuning(_build_parser().parse_args([*base, "--silence-probe-after", "0"]))
    assert off["silence_probe_after_s"] == 0
    assert main([*base, "--silence-probe-after", "20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["varuna-manager: error: --silence-probe-after must be 0 (off) or between 0 and "
                   "--heartbeat-timeout (15); got 20"], err
