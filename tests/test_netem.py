"""Tests of varuna.testing.netem: config strings, the link model, the delivery thread, and 2-process
gloo runs.

The multi-process tests start two ranks with ``torch.multiprocessing`` on 127.0.0.1 (gloo) and
compare times taken with ``time.monotonic`` in both processes (CLOCK_MONOTONIC is system-wide on
Linux), passing the sender's timestamp inside the payload.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from varuna.testing.netem import (
    NETEM_ENV_VAR,
    EmulatedNetwork,
    LinkModel,
    NetworkConfig,
    emulate_network,
)
from varuna.testing.netem import _Part as Part  # white-box: drive the delivery thread without a process group

# ------------------------------------------------------------------------------------------ config


def test_parse_full_string():
    cfg = NetworkConfig.parse("latency=1ms,jitter=2ms,bandwidth=1GB/s,seed=3")
    assert cfg == NetworkConfig(latency_s=0.001, jitter_mean_s=0.002, bandwidth_bytes_per_s=1e9, seed=3)
    assert str(cfg) == "latency=1ms,jitter=2ms,bandwidth=1GB/s,seed=3"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("latency=250us", NetworkConfig(latency_s=250e-6)),
        ("delay=5ms", NetworkConfig(latency_s=0.005)),  # tc-netem's word
        (" latency = 0.5s , seed = -2 ", NetworkConfig(latency_s=0.5, seed=-2)),
        ("bandwidth=10Gbit/s", NetworkConfig(bandwidth_bytes_per_s=1.25e9)),
        ("bandwidth=100Mbps", NetworkConfig(bandwidth_bytes_per_s=12.5e6)),
        ("bandwidth=2MiB/s", NetworkConfig(bandwidth_bytes_per_s=2 * 2**20)),
        ("bandwidth=inf,jitter=0", NetworkConfig()),
        ("", NetworkConfig()),
    ],
)
def test_parse_forms(text, expected):
    assert NetworkConfig.parse(text) == expected


@pytest.mark.parametrize(
    "config",
    [
        NetworkConfig(),
        NetworkConfig(latency_s=0.0011, jitter_mean_s=1 / 3, bandwidth_bytes_per_s=123456789.5, seed=7),
        NetworkConfig(latency_s=1e-7, bandwidth_bytes_per_s=1.0),
        NetworkConfig(latency_s=12.0, bandwidth_bytes_per_s=3 * 2**30),
    ],
)
def test_format_round_trips_exactly(config):
    assert NetworkConfig.parse(config.to_string()) == config
    assert NetworkConfig.from_env(config.to_env()) == config


@pytest.mark.parametrize(
    "text, names",
    [
        ("latency=abc", "latency='abc'"),
        ("latency=5", "latency='5'"),  # a unit is required (except for 0)
        ("latency=-1ms", "latency='-1ms'"),
        ("lat=1ms", "'lat'"),
        ("latency", "'latency'"),
        ("latency=1ms,latency=2ms", "'latency' given twice"),
        ("bandwidth=1gb/s", "bandwidth='1gb/s'"),  # case matters: b (bit) vs B (byte)
        ("bandwidth=0MB/s", "bandwidth='0MB/s'"),
        ("seed=1.5", "seed='1.5'"),
    ],
)
def test_parse_errors_name_the_problem_and_the_form(text, names):
    with pytest.raises(ValueError) as info:
        NetworkConfig.parse(text)
    message = str(info.value)
    assert names in message
    assert "latency=1ms,jitter=2ms,bandwidth=1GB/s,seed=3" in message
    assert "\n" not in message


def test_constructor_validates():
    with pytest.raises(ValueError, match="latency_s"):
        NetworkConfig(latency_s=-1.0)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        NetworkConfig(bandwidth_bytes_per_s=0)
    assert NetworkConfig(bandwidth_bytes_per_s=math.inf).bandwidth_bytes_per_s is None


def test_env_round_trip_and_unset():
    assert NetworkConfig.from_env({}) is None
    assert NetworkConfig.from_env({NETEM_ENV_VAR: "  "}) is None
    cfg = NetworkConfig(latency_s=0.003, seed=4)
    assert cfg.to_env() == {NETEM_ENV_VAR: "latency=3ms,seed=4"}
    with pytest.raises(ValueError, match=NETEM_ENV_VAR):
        NetworkConfig.from_env({NETEM_ENV_VAR: "latency=fast"})


# -------------------------------------------------------------------------------------- link model


def test_link_model_latency_bandwidth_and_serialisation():
    link = LinkModel(NetworkConfig(latency_s=0.01, bandwidth_bytes_per_s=1000.0), 0, 1)
    assert link.schedule(now_s=0.0, nbytes=100) == pytest.approx(0.11)
    assert link.schedule(now_s=0.0, nbytes=100) == pytest.approx(0.21)  # waits for the link
    assert link.schedule(now_s=5.0, nbytes=0) == pytest.approx(5.01)  # link idle again


def test_link_model_jitter_is_reproducible_per_seed_and_link():
    cfg = NetworkConfig(latency_s=0.001, jitter_mean_s=0.02, seed=42)

    def delays(config, src, dst, n=200):
        link = LinkModel(config, src, dst)
        return [link.schedule(now_s=float(i), nbytes=10) - i for i in range(n)]

    first = delays(cfg, 0, 1)
    assert first == delays(cfg, 0, 1)
    assert first != delays(cfg, 1, 0)
    assert first != delays(NetworkConfig(latency_s=0.001, jitter_mean_s=0.02, seed=43), 0, 1)
    # Messages 1 s apart never queue, so each delay is latency + one exponential draw.
    jitter = [d - 0.001 for d in first]
    assert min(jitter) >= 0
    assert sum(jitter) / len(jitter) == pytest.approx(0.02, rel=0.25)


def test_link_model_is_fifo_under_heavy_jitter():
    link = LinkModel(NetworkConfig(jitter_mean_s=1.0, seed=1), 0, 1)
    deliveries = [link.schedule(now_s=i * 0.01, nbytes=1) for i in range(500)]
    assert deliveries == sorted(deliveries)


# --------------------------------------------------------------- delivery thread (no process group)


class _FakeWork:
    def __init__(self, fail: bool = False):
        self.fail = fail

    def wait(self, timeout=None):
        if self.fail:
            raise RuntimeError("peer went away")
        return True


class _FakeSend:
    """Records (time, first element) of each real send; may fail on chosen sends."""

    def __init__(self, raise_on: int | None = None, fail_wait_on: int | None = None):
        self.calls: list[tuple[float, float]] = []
        self.raise_on, self.fail_wait_on = raise_on, fail_wait_on
        self.lock = threading.Lock()

    def __call__(self, tensor, group=None, tag=0, group_dst=None):
        with self.lock:
            index = len(self.calls)
            self.calls.append((time.monotonic(), float(tensor[0])))
        if index == self.raise_on:
            raise RuntimeError("connection reset")
        return _FakeWork(fail=index == self.fail_wait_on)


def _submit(net: EmulatedNetwork, value: float, dst: int = 1, numel: int = 1):
    tensor = torch.full((numel,), value)
    return net._submit(dst, [Part(tensor, None, dst, 0)])


def test_delivery_thread_honours_latency_and_fifo():
    fake = _FakeSend()
    net = EmulatedNetwork(NetworkConfig(latency_s=0.03, jitter_mean_s=0.02, seed=3), rank=0, send_fn=fake)
    messages = [_submit(net, float(i)) for i in range(30)]
    net.close(timeout_s=10)
    assert [value for _, value in fake.calls] == list(range(30))
    for message, (sent_at, _) in zip(messages, fake.calls):
        assert message.deliver_s - message.sent_s >= 0.03
        assert sent_at >= message.deliver_s  # never early
        assert sent_at <= message.deliver_s + 0.03  # and not much late
    assert net.link_stats()[(0, 1)].messages == 30
    assert not net._sender.is_alive() and not net._reaper.is_alive()


def test_close_flushes_pending_messages():
    fake = _FakeSend()
    net = EmulatedNetwork(NetworkConfig(latency_s=0.1), rank=0, send_fn=fake)
    start = time.monotonic()
    _submit(net, 1.0)
    net.close(timeout_s=10)
    assert len(fake.calls) == 1
    assert fake.calls[0][0] - start >= 0.1
    with pytest.raises(RuntimeError, match="closed"):
        _submit(net, 2.0)


def test_close_times_out_instead_of_hanging_when_a_receiver_never_comes():
    receiver_arrived = threading.Event()

    class _BlockedWork:
        def wait(self, timeout=None):
            return receiver_arrived.wait(10)

    net = EmulatedNetwork(NetworkConfig(), rank=0, send_fn=lambda *args, **kwargs: _BlockedWork())
    _submit(net, 1.0)
    with pytest.raises(TimeoutError, match="did not flush"):
        net.close(timeout_s=0.2)
    receiver_arrived.set()
    net.close(timeout_s=10)  # now it flushes and joins
    assert not net._sender.is_alive() and not net._reaper.is_alive()


def test_failed_real_send_is_reported_by_wait_later_sends_and_close():
    from varuna.testing.netem import _DeferredSendWork

    fake = _FakeSend(raise_on=1)
    net = EmulatedNetwork(NetworkConfig(latency_s=0.001), rank=0, send_fn=fake)
    works = [_DeferredSendWork(_submit(net, float(i)), torch.zeros(1)) for i in range(3)]
    assert all(w.is_completed() for w in works)  # the sender never waits for the network
    works[2]._message.done.wait(10)
    assert works[0].wait() is True
    with pytest.raises(RuntimeError, match="connection reset"):
        works[1].wait()
    with pytest.raises(RuntimeError):
        works[2].wait()  # not sent after the failure: FIFO could not hold
    with pytest.raises(RuntimeError, match="failed earlier"):
        _submit(net, 3.0)
    with pytest.raises(RuntimeError, match="deferred send failed"):
        net.close(timeout_s=10)


def test_failed_completion_is_reported():
    fake = _FakeSend(fail_wait_on=0)
    net = EmulatedNetwork(NetworkConfig(), rank=0, send_fn=fake)
    message = _submit(net, 0.0)
    assert message.done.wait(10)
    assert "peer went away" in str(message.error)
    with pytest.raises(RuntimeError, match="peer went away"):
        net.close(timeout_s=10)


def test_emulate_network_swaps_and_restores_functions():
    originals = (dist.isend, dist.batch_isend_irecv, c10d.isend, c10d.batch_isend_irecv, dist.send)
    with emulate_network("latency=1ms") as net:
        assert isinstance(net, EmulatedNetwork)
        assert dist.isend is c10d.isend is not originals[0]
        assert dist.batch_isend_irecv is c10d.batch_isend_irecv is not originals[1]
        assert dist.isend.__name__ == "isend"  # P2POp.__repr__ relies on it
        assert dist.send is originals[4]  # send reaches the emulator through c10d.isend
        with pytest.raises(RuntimeError, match="nested"), emulate_network("latency=1ms"):
            pass
    assert (dist.isend, dist.batch_isend_irecv, c10d.isend, c10d.batch_isend_irecv, dist.send) == originals
    assert not net._sender.is_alive() and not net._reaper.is_alive()

    with pytest.raises(KeyError), emulate_network(NetworkConfig(latency_s=0.001)) as net:
        raise KeyError("boom")
    assert (dist.isend, dist.batch_isend_irecv, c10d.isend, c10d.batch_isend_irecv, dist.send) == originals
    assert not net._sender.is_alive() and not net._reaper.is_alive()

    with emulate_network(None) as nothing:  # no config: the block runs unchanged
        assert nothing is None and dist.isend is originals[0]


# ------------------------------------------------------------------------- two gloo processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, scenario, port: int, out_dir: str, kwargs: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        result = scenario(rank, **kwargs)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run_two_ranks(scenario, tmp_path: Path, timeout_s: float = 60.0, **kwargs) -> list[dict]:
    """Run ``scenario(rank, **kwargs)`` on 2 gloo ranks; return each rank's JSON result."""
    context = mp.start_processes(_rank_main, args=(scenario, _free_port(), str(tmp_path), kwargs),
                                 nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):  # raises ProcessRaisedException if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{scenario.__name__} did not finish in {timeout_s} s")
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]


# Timing protocol of the scenarios below: the receiver posts all its receives BEFORE a barrier and
# the sender sends after it, so a receiver that is scheduled late (2 busy cores) cannot delay a
# delivery. Lower bounds hold for every message (load only ever makes things later); upper bounds
# are checked on the median lateness, so one scheduler hiccup does not fail a test, plus a loose
# bound on the worst message.
SLACK_S = 0.03  # allowed median lateness over the model (thread wake-ups, the real transfer)
WORST_SLACK_S = 0.25  # allowed lateness of any single message


def _post_receives(count: int, numel: int = 2, src: int = 0) -> list[tuple[torch.Tensor, dist.Work]]:
    buffers = [torch.empty(numel, dtype=torch.float64) for _ in range(count)]
    return [(buffer, dist.irecv(buffer, src)) for buffer in buffers]


def _collect(posted: list[tuple[torch.Tensor, dist.Work]]) -> list[tuple[float, float, float]]:
    """(sequence number, sender's timestamp, arrival time) of each message, in receive order."""
    received = []
    for buffer, work in posted:
        work.wait()
        received.append((buffer[0].item(), buffer[1].item(), time.monotonic()))
    return received


def _check_lateness(delays_s: list[float], expected_s: list[float]) -> None:
    lateness = sorted(d - e for d, e in zip(delays_s, expected_s))
    assert lateness[0] >= -0.05 * max(expected_s), f"delivered early: {lateness}"
    assert lateness[len(lateness) // 2] <= SLACK_S, f"median lateness too large: {lateness}"
    assert lateness[-1] <= WORST_SLACK_S, f"a message was very late: {lateness}"


def _latency_scenario(rank: int, latency_s: float, count: int) -> dict:
    with emulate_network(NetworkConfig(latency_s=latency_s)) as net:
        if rank == 1:
            posted = _post_receives(count + 1)
            dist.barrier()  # a collective: not delayed
            return {"received": _collect(posted)}
        try:
            dist.isend(torch.empty(2, device="meta"), 1)
            refused = False
        except RuntimeError as exc:
            refused = "CPU" in str(exc)
        dist.barrier()
        send_call_s = []
        for i in range(count + 1):
            payload = torch.tensor([float(i), time.monotonic()], dtype=torch.float64)
            start = time.monotonic()
            if i < count:
                dist.isend(payload, 1).wait()
            else:
                dist.send(payload, 1)  # the blocking send goes through the emulated isend
            send_call_s.append(time.monotonic() - start)
            payload.fill_(-1.0)  # the caller may reuse its buffer at once
        return {"send_call_s": send_call_s, "refused_meta": refused,
                "messages": net.link_stats()[(0, 1)].messages}


@pytest.mark.slow
def test_latency_delays_delivery_not_the_sender(tmp_path):
    latency_s, count = 0.05, 5
    sender, receiver = _run_two_ranks(_latency_scenario, tmp_path, latency_s=latency_s, count=count)
    assert sender["refused_meta"], "non-CPU tensors must be refused with a clear error"
    assert sender["messages"] == count + 1
    received = receiver["received"]
    assert [seq for seq, _, _ in received] == list(range(count + 1))
    delays = [arrived - sent for _, sent, arrived in received]
    assert min(delays) >= 0.95 * latency_s, delays
    _check_lateness(delays, [latency_s] * len(delays))
    # A sender that waited for delivery would spend ≥ latency_s in every call; the median keeps one
    # scheduler hiccup on a loaded host from failing the test.
    calls = sorted(sender["send_call_s"])
    assert calls[len(calls) // 2] < latency_s / 5 and calls[-1] < latency_s, calls


def _fifo_scenario(rank: int, config: str, count: int) -> dict:
    with emulate_network(config) as net:
        if rank == 1:
            posted = _post_receives(count)
            dist.barrier()
            return {"received": _collect(posted)}
        dist.barrier()
        for i in range(count):
            dist.isend(torch.tensor([float(i), time.monotonic()], dtype=torch.float64), 1)
        return {"messages": net.link_stats()[(0, 1)].messages}


@pytest.mark.slow
def test_fifo_and_reproducible_jitter_end_to_end(tmp_path):
    config, count = "latency=1ms,jitter=20ms,seed=5", 40
    sender, receiver = _run_two_ranks(_fifo_scenario, tmp_path, config=config, count=count)
    assert sender["messages"] == count
    received = receiver["received"]
    assert [seq for seq, _, _ in received] == list(range(count))
    # The seed fixes the link's jitter draws: replaying the send times through the link model
    # predicts each delivery (the real send is issued a few microseconds after the timestamp).
    link = LinkModel(NetworkConfig.parse(config), 0, 1)
    predicted = [link.schedule(sent, nbytes=16) - sent for _, sent, _ in received]
    delays = [arrived - sent for _, sent, arrived in received]
    assert all(d >= p - 0.001 for d, p in zip(delays, predicted)), list(zip(delays, predicted))
    _check_lateness(delays, predicted)
    assert max(delays) - min(delays) > 0.01, "jitter was not applied"


def _bandwidth_scenario(rank: int, config: str, numel: int, count: int) -> dict:
    with emulate_network(config):
        if rank == 1:
            posted = _post_receives(count, numel)
            dist.barrier()
            return {"received": _collect(posted)}
        dist.barrier()
        send_call_s = []
        for i in range(count):
            payload = torch.zeros(numel, dtype=torch.float64)
            payload[0], payload[1] = float(i), time.monotonic()
            start = time.monotonic()
            dist.isend(payload, 1)
            send_call_s.append(time.monotonic() - start)
        return {"send_call_s": send_call_s}


@pytest.mark.slow
def test_bandwidth_serialises_large_messages(tmp_path):
    numel, count = 250_000, 4  # 2 MB of float64 each
    sender, receiver = _run_two_ranks(_bandwidth_scenario, tmp_path, config="bandwidth=50MB/s",
                                      numel=numel, count=count)
    transfer_s = numel * 8 / 50e6  # 40 ms per message
    received = receiver["received"]
    assert [seq for seq, _, _ in received] == list(range(count))
    first_sent = received[0][1]
    # Sent back to back, message k is queued behind the k before it: it arrives at (k+1)·40 ms.
    delays = [arrived - first_sent for _, _, arrived in received]
    expected = [(k + 1) * transfer_s for k in range(count)]
    assert all(d >= 0.95 * e for d, e in zip(delays, expected)), list(zip(delays, expected))
    _check_lateness(delays, expected)
    calls = sorted(sender["send_call_s"])  # a waiting sender: ≥ transfer_s in every call
    assert calls[len(calls) // 2] < transfer_s / 2 and calls[-1] < transfer_s, calls


def _batch_scenario(rank: int, config: str) -> dict:
    peer = 1 - rank
    with emulate_network(config) as net:
        if rank == 1:
            header = torch.empty(2, dtype=torch.float64)
            payload = torch.empty(3, dtype=torch.float64)
            recv_works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, header, peer),
                                                 dist.P2POp(dist.irecv, payload, peer)])
            dist.barrier()
            ack = torch.tensor([time.monotonic()], dtype=torch.float64)
            dist.batch_isend_irecv([dist.P2POp(dist.isend, ack, peer)])
            recv_works[0].wait()
            header_delay = time.monotonic() - header[0].item()
            recv_works[1].wait()
            payload_delay = time.monotonic() - header[0].item()
            return {"header_delay": header_delay, "payload_delay": payload_delay,
                    "payload": payload.tolist(), "messages": net.link_stats()[(1, 0)].messages}
        dist.barrier()
        header = torch.tensor([time.monotonic(), 3.0], dtype=torch.float64)
        payload = torch.arange(3, dtype=torch.float64)
        ack = torch.empty(1, dtype=torch.float64)
        works = dist.batch_isend_irecv([  # sends and a receive in one batch, as 1F1B does
            dist.P2POp(dist.isend, header, peer),  # P2POp accepts the swapped isend
            dist.P2POp(dist.isend, payload, peer),
            dist.P2POp(dist.irecv, ack, peer),
        ])
        works[2].wait()
        ack_delay = time.monotonic() - ack.item()
        stats = net.link_stats()[(0, 1)]
        return {"works": len(works), "messages": stats.messages, "nbytes": stats.nbytes,
                "ack_delay": ack_delay}


@pytest.mark.slow
def test_batch_is_one_message(tmp_path):
    config = "latency=50ms,jitter=10ms,seed=11"
    sender, receiver = _run_two_ranks(_batch_scenario, tmp_path, config=config)
    cfg = NetworkConfig.parse(config)
    # One message = one latency and ONE jitter draw, the first of each link's sequence.
    expected_01 = cfg.latency_s + LinkModel(cfg, 0, 1).draw_jitter_s()
    expected_10 = cfg.latency_s + LinkModel(cfg, 1, 0).draw_jitter_s()
    assert sender["works"] == 3
    assert sender["messages"] == 1 and sender["nbytes"] == 5 * 8
    assert receiver["messages"] == 1
    assert receiver["payload"] == [0.0, 1.0, 2.0]
    delays = [receiver["header_delay"], receiver["payload_delay"], sender["ack_delay"]]
    expected = [expected_01, expected_01, expected_10]
    assert all(d >= 0.95 * e for d, e in zip(delays, expected)), list(zip(delays, expected))
    _check_lateness(delays, expected)


def _pipeline_step(rank, module, schedule, x, y) -> tuple[float, list[torch.Tensor]]:
    """One training step of a 2-stage schedule: (stage's wall time, its parameter gradients)."""
    module.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.monotonic()
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    elapsed_s = time.monotonic() - start
    return elapsed_s, [p.grad.clone() for p in module.parameters()]


def _pipelining_scenario(rank: int, latency_s: float, jitter_s: float) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    reference = copy.deepcopy(full)
    F.mse_loss(reference(x), y).backward()
    reference_part = (reference[:2], reference[2:])[rank]
    results = {}
    for name, schedule_cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        module = copy.deepcopy((full[:2], full[2:])[rank])
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        schedule = schedule_cls(stage, n_microbatches=4, loss_fn=F.mse_loss)

        # Warm-up step: shape inference and communicator set-up happen on the first step.
        _pipeline_step(rank, module, schedule, x, y)
        plain_s, plain_grads = _pipeline_step(rank, module, schedule, x, y)
        config = NetworkConfig(latency_s=latency_s, jitter_mean_s=jitter_s, seed=1)
        with emulate_network(config) as net:
            emulated_s, emulated_grads = _pipeline_step(rank, module, schedule, x, y)
            messages = sum(s.messages for s in net.link_stats().values())
        results[name] = {
            "plain_s": plain_s,
            "emulated_s": emulated_s,
            "messages": messages,
            "same_grads": all(torch.equal(a, b) for a, b in zip(plain_grads, emulated_grads)),
            "reference_error": max((g - p.grad).abs().max().item()
                                   for g, p in zip(emulated_grads, reference_part.parameters())),
        }
    return results


@pytest.mark.slow
def test_wraps_torch_pipelining_schedules(tmp_path):
    latency_s, jitter_s = 0.05, 0.005
    ranks = _run_two_ranks(_pipelining_scenario, tmp_path, latency_s=latency_s, jitter_s=jitter_s)
    # Round trips of latency on stage 0's critical path (compute is negligible): GPipe sends all
    # forwards, then waits for the gradients (2 hops); 1F1B with 2 warm-up forwards on stage 0
    # waits for gradients of micro-batches 0-1, then sends 2-3 and waits again (4 hops).
    hops = {"gpipe": 2, "1f1b": 4}
    for name, expected_hops in hops.items():
        for rank, result in enumerate(ranks):
            r = result[name]
            assert r["same_grads"], f"{name} rank {rank}: gradients changed under emulation"
            assert r["reference_error"] < 1e-5, f"{name} rank {rank}: {r['reference_error']}"
            assert r["messages"] == 4, f"{name} rank {rank}: {r['messages']} messages"
        r = ranks[0][name]
        expected_s = expected_hops * latency_s
        assert r["emulated_s"] >= 0.95 * expected_s, (name, r)
        # Generous upper bound (a loaded 2-core CI box delays threads); per-message latency bounds
        # are checked tightly in the dedicated latency tests above.
        assert r["emulated_s"] - r["plain_s"] <= 2 * expected_s + 0.5, (name, r)
