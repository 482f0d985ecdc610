"""``varuna-profile --host-list``: calibration over the job's real hosts, reached with OpenSSH (Note
[Calibrating real links] in profiler/hosts.py). Fast: the host list's parsing and the remote
command's quoting. Slow (root): the profiler on two hosts in network namespaces whose links
``tbf`` caps, the calibrated bandwidths bounded by the cap (a loaded machine only slows a link
down: the cap is a bound no measurement may exceed by more than the bucket; each measures at
least 90 % of it, the match scripts/calibrate_hosts.py checks, docs/profiling.md), and the
file's runtime_overheads measured by the workers on those hosts (Note [Overheads on the hosts] in
profiler/overhead_phase.py)."""

from __future__ import annotations

import doctest
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import profiler.overhead_phase
from profiler.cli import build_parser
from profiler.hosts import RemoteHost
from profiler.overhead_phase import reduce_overheads
from profiler.overheads import RuntimeConstants
from profiler.runner import ProfileOptions
from varuna.testing.netns import NetHosts, netns_unavailable
from varuna.testing.sshd import sshd_unavailable

ROOT = Path(__file__).resolve().parents[1]
WHY_NOT = netns_unavailable() or sshd_unavailable()


@pytest.mark.parametrize("bad", ["-oProxyCommand=x", "a b", "h:0", "h:99999", "a@b@c", ""])
def test_a_bad_host_list_entry_is_one_line(bad):
    with pytest.raises(ValueError) as err:
        RemoteHost.parse(bad)
    assert "is not [user@]host[:port]" in str(err.value) and "\n" not in str(err.value)


def test_overhead_phase_docstring_examples():
    failures, tried = doctest.testmod(profiler.overhead_phase)
    assert failures == 0 and tried >= 2


def test_the_overheads_phase_reduces_every_workers_rounds(monkeypatch):
    seen = []

    def fake_constants(ranks):
        seen.append(ranks)
        return RuntimeConstants(handoff_s=1e-4, handoff_netem_s=1e-4, probe_handoff_s=1e-4,
                                task_overhead_s=5e-4, segment_overhead_s=1e-4, placeholder_s=4e-5,
                                step_overhead_s=2e-3, allreduce_s=1e-3)

    monkeypatch.setattr(profiler.overhead_phase, "runtime_constants", fake_constants)
    results = [{"rank": r, "bench": [{"round": r}]} for r in range(4)]  # the phase's ranks
    section, rc = reduce_overheads(results, "2 hosts over ssh (a, b, real links)")
    assert seen == [[{"bench": [{"round": r}]} for r in range(4)]]
    assert (section.task_overhead_s, section.placeholder_s, section.step_overhead_s) == (5e-4, 4e-5, 2e-3)
    assert section.source == ("varuna-profile runtime-overheads phase, W=4 on 2 hosts over ssh (a, b, "
                              "real links)")
    # A worker without its measurements (an old worker, a plan without the phase): one line.
    with pytest.raises(RuntimeError) as err:
        reduce_overheads([*results[:3], {"rank": 3}], "x")
    assert "no runtime-overhead measurements" in str(err.value) and "\n" not in str(err.value)


def test_the_overheads_phase_is_on_by_default_only_over_ssh():
    assert ProfileOptions().runtime_overheads is None
    assert build_parser().parse_args(["--model", "m:f", "--micro-batch-sizes", "2", "--out", "x",
                                      "--no-runtime-overheads"]).runtime_overheads is False
    with pytest.raises(ValueError, match="--overhead-steps must be >= 1"):
        ProfileOptions(overhead_steps=0).validate()


def test_the_remote_command_quotes_every_word_but_ppid():
    host = RemoteHost.parse("bob@h1:2222", key_file="/keys/id")
    argv = host.argv(["python3", "-m", "profiler.worker", "/tmp/run $(reboot)"], {"PYTHONPATH": "/a b"},
                     cwd="/src/my repo")
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "bob"
    assert argv[-2:-1] == ["h1"] and argv[-3] == "--"
    remote = argv[-1]
    words = shlex.split(remote)  # what the remote login shell parses
    assert words[:2] == ["cd", "/src/my repo"]
    assert "$(reboot)" not in remote.replace("'/tmp/run $(reboot)'", ""), "only inside single quotes"
    assert "export VARUNA_PARENT_PID=$PPID" in remote and words[-1] == "/tmp/run $(reboot)"
    assert "PYTHONPATH=/a b" in words


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(WHY_NOT is not None, reason=f"hosts in namespaces: {WHY_NOT}")
def test_host_list_calibrates_real_links_bounded_by_their_cap(tmp_path: Path):
    rate = 12.5e6  # 100 Mbit/s each way
    out = tmp_path / "cal.json"
    with NetHosts.create(2, workdir=tmp_path, rate_bytes_per_s=rate) as net:
        cmd = [sys.executable, "-m", "profiler.cli", "--model",
               f"{ROOT / 'examples' / 'gpt2' / 'profile_target.py'}:build", "--model-arg", "n_layer=2",
               "--model-arg", "n_embd=64", "--model-arg", "n_head=2", "--model-arg", "block_size=32",
               "--micro-batch-sizes", "2", "--out", str(out), "--host-list",
               f"{net.address(0)},{net.address(1)}", "--procs-per-host", "2", "--quiet", *net.ssh_options()]
        run = subprocess.run(net.control(cmd), capture_output=True, text=True, timeout=500, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
        assert run.returncode == 0, run.stderr[-3000:]
        assert not any(net.pids(h) for h in range(2)), "a profiler worker outlived the run"
    cal = json.loads(out.read_text())
    [entry] = cal["profiler"]["history"]
    assert "2 hosts over ssh (10.214.0.1, 10.214.0.2, real links)" in entry["hosts"], entry
    # Over the cap is impossible (the bucket lets 128 KiB pass at line rate: 15 % of slack covers
    # it on these sizes). Under it by more than 10 % means the link is timed off its steady state
    # (Note [Steady-state sends] in profiler/network.py: timing first sends read 23 % low); TCP/IP
    # framing, which the cap counts and the payload does not, costs ~4 %.
    for what, bw in (("inter", cal["links"]["inter"]["bandwidth_bytes_per_s"]),
                     ("allreduce", cal["allreduce"]["bandwidth_bytes_per_s"])):
        assert 0.9 * rate <= bw < 1.15 * rate, (what, bw / rate)
    # The intra-host link is loopback inside one namespace: not capped.
    assert cal["links"]["intra"]["bandwidth_bytes_per_s"] > 2 * rate
    # The engine's own costs, measured by the workers on those hosts (Note [Overheads on the
    # hosts]): without the phase the file has no section and the simulator adds nothing for them.
    ro = cal.get("runtime_overheads")
    assert ro is not None and "W=2 on 2 hosts over ssh" in ro["source"], ro  # one worker per host
    assert ro["task_overhead_s"] > 0 and ro["step_overhead_s"] > 0, ro
    assert cal["profiler"]["runtime_constants"]["samples"]["tasks"] > 0
