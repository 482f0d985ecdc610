"""Network emulation at the ``torch.distributed`` point-to-point layer.

Kernel network emulation (``tc qdisc ... netem``) is not available where varuna is developed and
tested, so this module emulates a slow network inside each process: every point-to-point message a
process *sends* is held back and handed to the real backend only at the time it would have arrived
over the emulated link. What is delayed is the *delivery*, never the sender's compute: the sender's
``isend`` returns a request that is already complete, and the receiver's unchanged ``irecv``
completes when the message is finally handed over.

The link model (one directed link per (source rank, destination rank) pair, see :class:`LinkModel`)::

    start      = max(now, link_free)                    # the link sends one message at a time
    link_free  = start + nbytes / bandwidth             # serialisation (0 when bandwidth is None)
    delivery   = max(previous delivery on the link,     # FIFO: a link never reorders
                     link_free + latency + jitter)      # jitter ~ Exponential(mean=jitter_mean_s)

Example (a process that should see 1 ms latency, 2 ms mean jitter and 1 GB/s links)::

    >>> cfg = NetworkConfig.parse("latency=1ms,jitter=2ms,bandwidth=1GB/s,seed=3")
    >>> cfg.latency_s, cfg.bandwidth_bytes_per_s
    (0.001, 1000000000.0)
    >>> NetworkConfig.parse(str(cfg)) == cfg
    True

and in a worker (after ``init_process_group``; every rank should do the same)::

    with emulate_network(NetworkConfig.from_env()):     # None (VARUNA_NETEM unset) = no emulation
        train()

Note [Swapping torch.distributed functions]: :func:`emulate_network` is the ONE place in varuna
that replaces functions of ``torch.distributed``. It swaps ``isend`` and ``batch_isend_irecv`` in
both ``torch.distributed`` and ``torch.distributed.distributed_c10d``, process-locally and only
for the duration of the ``with`` block, and restores the previous objects on exit (also when the
block raises). Why swap rather than pass an emulator object around: the emulation must also apply
to code we do not own (``torch.distributed.pipelining``'s schedules build
``dist.P2POp(dist.isend, ...)`` and call ``dist.batch_isend_irecv``), and both varuna's runtime
and torch look these functions up as module attributes at call time, so swapping the attributes
reaches every caller in the process. Why both modules: ``P2POp.__new__`` validates its ``op`` by
comparing it with the ``isend``/``irecv`` globals of ``distributed_c10d``, and ``send`` /
``send_object_list`` call ``isend`` through those globals too. Swapping the c10d global makes
``P2POp(dist.isend, ...)`` valid while patched and routes the blocking ``send`` (which is
``isend(...).wait()``) through the emulator without touching ``send`` itself. Receives
(``irecv``, ``recv``) are never touched: their completion naturally reflects the delayed delivery.

What is not intercepted: collectives (all-reduce, barrier, broadcast; they are not point-to-point),
references captured before the block (``from torch.distributed import isend`` at import time), and
P2POp objects built *before* the block with the original ``isend`` are still handled by the
emulated ``batch_isend_irecv`` but cannot be *created* inside it (``P2POp`` rejects the stale
function). Sends to oneself are not delayed (no network is involved).

Costs: each emulated send copies its tensor once on the caller's thread (the caller may reuse its
buffer as soon as ``isend`` returns, as the request is already complete), and the copy is held
until the receiver has taken it. A sender far ahead of its receivers therefore holds memory for
every message in flight, exactly like a real network buffer would not: keep that in mind for
very large activations. Delivery times are honoured to about a millisecond (thread wake-up and the
GIL); emulation is for CPU tensors over gloo only (CUDA tensors are refused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import itertools
import logging
import math
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from varuna.core.env import WorkerSettings

__all__ = [
    "NETEM_ENV_VAR",
    "NetworkConfig",
    "LinkModel",
    "LinkStats",
    "EmulatedNetwork",
    "emulate_network",
]

logger = logging.getLogger(__name__)

#: Environment variable through which the launcher/runtime pass a :class:`NetworkConfig` to workers.
NETEM_ENV_VAR = "VARUNA_NETEM"

_ACCEPTED_FORM = "accepted form: latency=1ms,jitter=2ms,bandwidth=1GB/s,seed=3 (every key optional)"

# Scale factors. Durations and bandwidths are parsed as float(number) / divisor or * multiplier so
# that formatting can check an exact round trip (see _format_quantity).
_DURATION_UNITS: dict[str, tuple[str, float]] = {
    # unit -> ("div" | "mul", factor): seconds = number / factor or number * factor
    "s": ("mul", 1.0),
    "ms": ("div", 1e3),
    "us": ("div", 1e6),
    "µs": ("div", 1e6),
}
_BANDWIDTH_UNITS: dict[str, tuple[str, float]] = {
    "B/s": ("mul", 1.0),
    "KB/s": ("mul", 1e3),
    "MB/s": ("mul", 1e6),
    "GB/s": ("mul", 1e9),
    "TB/s": ("mul", 1e12),
    "KiB/s": ("mul", 2.0**10),
    "MiB/s": ("mul", 2.0**20),
    "GiB/s": ("mul", 2.0**30),
    "bit/s": ("div", 8.0),
    "Kbit/s": ("mul", 1e3 / 8),
    "Mbit/s": ("mul", 1e6 / 8),
    "Gbit/s": ("mul", 1e9 / 8),
    "Kbps": ("mul", 1e3 / 8),
    "Mbps": ("mul", 1e6 / 8),
    "Gbps": ("mul", 1e9 / 8),
}
# Units format() may choose, preferred in this order when equally short.
_DURATION_FORMAT_UNITS = ("ms", "us", "s")
_BANDWIDTH_FORMAT_UNITS = ("GB/s", "MB/s", "KB/s", "B/s", "GiB/s", "MiB/s", "KiB/s", "Gbit/s", "Mbit/s")
_QUANTITY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]+)\s*$")


def _apply_unit(number: float, rule: tuple[str, float]) -> float:
    kind, factor = rule
    return number / factor if kind == "div" else number * factor


def _parse_quantity(key: str, text: str, units: Mapping[str, tuple[str, float]], what: str) -> float:
    """Parse ``"<number><unit>"``; a bare ``0`` is allowed (zero needs no unit)."""
    if text.strip() in ("0", "0.0"):
        return 0.0
    match = _QUANTITY_RE.match(text)
    if match is None or match.group(2) not in units:
        raise ValueError(
            f"bad network config value {key}={text!r}: expected {what} with a unit "
            f"({', '.join(units)}); {_ACCEPTED_FORM}"
        )
    return _apply_unit(float(match.group(1)), units[match.group(2)])


def _format_quantity(value: float, units: Mapping[str, tuple[str, float]], order: Sequence[str]) -> str:
    """The shortest ``<number><unit>`` that parses back to exactly ``value``."""
    if value == 0:
        return "0"
    best: str | None = None
    for unit in order:
        kind, factor = units[unit]
        number = value * factor if kind == "div" else value / factor
        text = f"{number:.15g}"
        # Keep the short form only if it parses back to the very same float.
        if _apply_unit(float(text), units[unit]) != value:
            text = repr(number)
            if _apply_unit(float(text), units[unit]) != value:
                continue
        candidate = text + unit
        if best is None or len(candidate) < len(best):
            best = candidate
    if best is None:  # cannot happen for finite floats (the "s" / "B/s" units are exact)
        raise AssertionError(f"no exact format for {value!r}")
    return best


@dataclass(kw_only=True, frozen=True)
class NetworkConfig:
    """The emulated network: the same model for every directed link between two ranks.

    Example::

        >>> NetworkConfig(latency_s=0.002, bandwidth_bytes_per_s=125e6).to_string()
        'latency=2ms,bandwidth=125MB/s'
        >>> NetworkConfig.parse("latency=50us,jitter=1ms").jitter_mean_s
        0.001
    """

    latency_s: float = 0.0
    """Fixed one-way delay added to every message (propagation + fixed software overheads)."""
    jitter_mean_s: float = 0.0
    """Mean of an exponentially distributed extra delay, drawn per message (0 = no jitter)."""
    bandwidth_bytes_per_s: float | None = None
    """Link bandwidth; a message occupies its link for ``nbytes / bandwidth``. None = infinite."""
    seed: int = 0
    """Seed of the jitter draws; each link (src, dst) has its own reproducible sequence."""

    def __post_init__(self) -> None:
        for name in ("latency_s", "jitter_mean_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"NetworkConfig.{name} must be a finite number >= 0, got {value!r}")
        bw = self.bandwidth_bytes_per_s
        if bw is not None and not (isinstance(bw, (int, float)) and bw > 0 and not math.isnan(bw)):
            raise ValueError(
                f"NetworkConfig.bandwidth_bytes_per_s must be > 0 or None (infinite), got {bw!r}"
            )
        if bw is not None and math.isinf(bw):
            object.__setattr__(self, "bandwidth_bytes_per_s", None)  # "inf" means no limit
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"NetworkConfig.seed must be an int, got {self.seed!r}")

    @classmethod
    def parse(cls, text: str) -> NetworkConfig:
        """Parse ``"latency=1ms,jitter=2ms,bandwidth=1GB/s,seed=3"`` (every key optional).

        ``delay`` is accepted as an alias of ``latency`` (tc-netem's word). Raises ``ValueError``
        with a one-line message naming the bad key or value and the accepted form.
        """
        fields: dict[str, Any] = {}
        seen: set[str] = set()
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            key, sep, value = item.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not sep or not value:
                raise ValueError(f"bad network config item {item!r} in {text!r}: expected key=value; "
                                 f"{_ACCEPTED_FORM}")
            key = "latency" if key == "delay" else key
            if key in seen:
                raise ValueError(f"network config key {key!r} given twice in {text!r}; {_ACCEPTED_FORM}")
            seen.add(key)
            if key == "latency":
                fields["latency_s"] = _parse_quantity(key, value, _DURATION_UNITS, "a duration")
            elif key == "jitter":
                fields["jitter_mean_s"] = _parse_quantity(key, value, _DURATION_UNITS, "a duration")
            elif key == "bandwidth":
                if value.lower() in ("inf", "none", "unlimited"):
                    fields["bandwidth_bytes_per_s"] = None
                else:
                    bw = _parse_quantity(key, value, _BANDWIDTH_UNITS, "a bandwidth")
                    if bw <= 0:
                        raise ValueError(f"bad network config value bandwidth={value!r}: must be > 0 "
                                         f"(or 'inf'); {_ACCEPTED_FORM}")
                    fields["bandwidth_bytes_per_s"] = bw
            elif key == "seed":
                try:
                    fields["seed"] = int(value)
                except ValueError:
                    raise ValueError(f"bad network config value seed={value!r}: expected an integer; "
                                     f"{_ACCEPTED_FORM}") from None
            else:
                raise ValueError(f"unknown network config key {key!r} in {text!r}: accepted keys are "
                                 f"latency (alias delay), jitter, bandwidth, seed; {_ACCEPTED_FORM}")
        return cls(**fields)

    def to_string(self) -> str:
        """The compact form :meth:`parse` reads back exactly; default-valued keys are left out."""
        duration = functools.partial(_format_quantity, units=_DURATION_UNITS, order=_DURATION_FORMAT_UNITS)
        parts = []
        if self.latency_s:
            parts.append("latency=" + duration(self.latency_s))
        if self.jitter_mean_s:
            parts.append("jitter=" + duration(self.jitter_mean_s))
        if self.bandwidth_bytes_per_s is not None:
            parts.append("bandwidth=" + _format_quantity(self.bandwidth_bytes_per_s, _BANDWIDTH_UNITS,
                                                         _BANDWIDTH_FORMAT_UNITS))
        if self.seed:
            parts.append(f"seed={self.seed}")
        # An all-default config is written "latency=0", not "", so it survives to_env/from_env
        # (an empty VARUNA_NETEM means "no emulation").
        return ",".join(parts) or "latency=0"

    __str__ = to_string

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NetworkConfig | None:
        """Read ``VARUNA_NETEM`` from ``environ`` (default ``os.environ``); None when unset or empty.

        Example::

            >>> NetworkConfig.from_env({}) is None
            True
            >>> NetworkConfig.from_env({"VARUNA_NETEM": "latency=5ms"}).latency_s
            0.005
        """
        return cls.from_setting(WorkerSettings.from_env(environ).netem)

    @classmethod
    def from_setting(cls, text: str | None) -> NetworkConfig | None:
        """The config of a ``VARUNA_NETEM`` value (``WorkerSettings.netem``); None when unset or
        empty, ``ValueError`` naming the variable when malformed.

        Example::

            >>> NetworkConfig.from_setting("latency=5ms").latency_s
            0.005
        """
        if text is None or not text.strip():
            return None
        try:
            return cls.parse(text)
        except ValueError as exc:
            raise ValueError(f"{NETEM_ENV_VAR}: {exc}") from None

    def to_env(self) -> dict[str, str]:
        """The environment variables that make :meth:`from_env` return this config in a worker."""
        return {NETEM_ENV_VAR: self.to_string()}

    def transfer_s(self, nbytes: int) -> float:
        """Time the link is busy serialising ``nbytes`` (0 with infinite bandwidth)."""
        return 0.0 if self.bandwidth_bytes_per_s is None else nbytes / self.bandwidth_bytes_per_s


class LinkModel:
    """Delivery times on one directed link ``src → dst``: pure arithmetic, no clock, no torch.

    The jitter draws come from a ``random.Random`` seeded from ``(seed, src, dst)``, so a link's
    sequence of delays is reproducible and independent of traffic on other links.

    Example::

        >>> link = LinkModel(NetworkConfig(latency_s=0.01, bandwidth_bytes_per_s=1000.0), 0, 1)
        >>> round(link.schedule(now_s=0.0, nbytes=100), 6)   # 0.1 s on the wire + 10 ms latency
        0.11
        >>> round(link.schedule(now_s=0.0, nbytes=100), 6)   # queued behind the first message
        0.21
    """

    def __init__(self, config: NetworkConfig, src: int, dst: int) -> None:
        self.config = config
        self.src, self.dst = src, dst
        # A string seed is hashed with SHA-512 by random.seed, so it is stable across runs and
        # unaffected by PYTHONHASHSEED.
        self._rng = random.Random(f"varuna-netem:{config.seed}:{src}:{dst}")
        self._link_free_s = -math.inf
        self._last_delivery_s = -math.inf

    def draw_jitter_s(self) -> float:
        """The next jitter draw of this link (0 without jitter; consumes no randomness then)."""
        mean = self.config.jitter_mean_s
        return self._rng.expovariate(1.0 / mean) if mean > 0 else 0.0

    def schedule(self, now_s: float, nbytes: int) -> float:
        """Enqueue a message of ``nbytes`` sent at ``now_s``; return its delivery time."""
        start_s = max(now_s, self._link_free_s)
        self._link_free_s = start_s + self.config.transfer_s(nbytes)
        arrival_s = self._link_free_s + self.config.latency_s + self.draw_jitter_s()
        self._last_delivery_s = max(self._last_delivery_s, arrival_s)
        return self._last_delivery_s


@dataclass
class LinkStats:
    """Traffic counters of one directed link, as seen by the sending process."""

    messages: int = 0
    """Emulated messages (one isend, or all sends to one peer in one batch_isend_irecv)."""
    nbytes: int = 0
    """Payload bytes of those messages."""
    delay_s: float = 0.0
    """Sum over messages of (delivery time - send time)."""


@dataclass(eq=False)
class _Part:
    """One real send of a message: the copied tensor and the arguments of the real ``isend``."""

    tensor: torch.Tensor
    group: dist.ProcessGroup
    group_dst: int
    tag: int


@dataclass(eq=False)
class _Message:
    """The unit of emulation: one latency, one jitter draw, FIFO with the link's other messages."""

    src: int
    dst: int
    parts: list[_Part]
    nbytes: int
    sent_s: float
    deliver_s: float
    error: BaseException | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def describe(self) -> str:
        return f"message {self.src}->{self.dst} ({self.nbytes} bytes, {len(self.parts)} tensor(s))"


class _DeferredSendWork(dist.Work):
    """The request returned for an emulated send: complete as soon as it is created.

    The sender must never wait for the emulated network (that would delay its compute), so
    ``wait()`` returns at once -- but it raises if the deferred real send has failed by then,
    so errors are not silently lost.
    """

    def __init__(self, message: _Message, tensor: torch.Tensor) -> None:
        super().__init__()
        self._message = message
        self._tensor = tensor

    def wait(self, timeout: timedelta | None = None) -> bool:  # nothing to wait for: see above
        error = self._message.error
        if error is not None:
            raise RuntimeError(f"emulated {self._message.describe()} failed: {error}") from error
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._message.error is None

    def result(self) -> list[torch.Tensor]:
        return [self._tensor]

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([self._tensor])
        return future


_STOP = object()


class EmulatedNetwork:
    """Delays the delivery of this process's point-to-point sends according to a NetworkConfig.

    It owns two daemon threads: a *sender* that issues each real ``isend`` at its message's
    delivery time (messages leave in delivery order, so FIFO per link holds), and a *reaper*
    that waits (with ``timeout_s``) for the real sends to complete and records failures. Use its
    :meth:`isend` / :meth:`batch_isend_irecv` directly, or let :func:`emulate_network` install
    them process-wide. ``close()`` delivers what is still queued and joins both threads.

    Example::

        with EmulatedNetwork(NetworkConfig(latency_s=0.05)) as net:
            net.isend(torch.ones(4), dst=1).wait()  # returns at once; rank 1 gets it ~50 ms later
    """

    def __init__(
        self, config: NetworkConfig, *, rank: int | None = None, timeout_s: float = 300.0,
        send_fn: Callable[..., dist.Work | None] | None = None,
    ) -> None:
        """Args:
            config: the link model applied to every destination.
            rank: this process's global rank (default: ``dist.get_rank()`` at the first send).
            timeout_s: how long a real send may wait for its receiver before the network fails.
            send_fn: the real send, called as ``send_fn(tensor, group=, tag=, group_dst=)`` on the
                sender thread (default: torch's ``isend`` as it is now; tests inject a fake).
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.config = config
        self.timeout_s = timeout_s
        self._rank = rank
        self._clock = time.monotonic  # system-wide on Linux: comparable across processes
        # The real functions, captured now so a later swap (emulate_network) cannot recurse.
        self._real_isend = c10d.isend
        self._send_fn = send_fn if send_fn is not None else c10d.isend
        self._real_irecv = c10d.irecv
        self._real_batch = c10d.batch_isend_irecv
        self._cond = threading.Condition()  # guards everything below
        self._links: dict[tuple[int, int], LinkModel] = {}
        self._stats: dict[tuple[int, int], LinkStats] = {}
        self._heap: list[tuple[float, int, _Message]] = []
        self._seq = itertools.count()  # tie-break: equal delivery times leave in submit order
        self._closing = False
        self._drop = False
        self._error: BaseException | None = None
        self._reap_queue: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="varuna-netem-send", daemon=True)
        self._reaper = threading.Thread(target=self._reap_loop, name="varuna-netem-reap", daemon=True)
        self._sender.start()
        self._reaper.start()

    # ----------------------------------------------------------------- public API
    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def error(self) -> BaseException | None:
        """The first failure of a deferred send, if any (the network stops sending after it)."""
        return self._error

    def link_stats(self) -> dict[tuple[int, int], LinkStats]:
        """Per directed link ``(src, dst)``: counters of the messages this process sent."""
        with self._cond:
            return {link: dataclasses.replace(stats) for link, stats in self._stats.items()}

    def isend(
        self, tensor: torch.Tensor, dst: int | None = None, group: dist.ProcessGroup | None = None,
        tag: int = 0, group_dst: int | None = None,
    ) -> dist.Work | None:
        """Emulated ``torch.distributed.isend`` (same signature); the request is already complete."""
        group = group if group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0 or (dst is None) == (group_dst is None):
            # Not a member of `group`, or bad peer arguments: the real isend warns/raises as usual.
            return self._real_isend(tensor, dst, group=group, tag=tag, group_dst=group_dst)
        if group_dst is None:
            group_dst = dist.get_group_rank(group, dst)
        else:
            dst = dist.get_global_rank(group, group_dst)
        if dst == self._my_rank():
            return self._real_isend(tensor, group=group, tag=tag, group_dst=group_dst)  # no network
        _check_tensor(tensor)
        part = _Part(_copy(tensor), group, group_dst, tag)
        message = self._submit(dst, [part])
        return _DeferredSendWork(message, tensor)

    def batch_isend_irecv(self, p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
        """Emulated ``torch.distributed.batch_isend_irecv``.

        All sends to one destination form ONE message (one latency, one jitter draw, FIFO), e.g.
        a shape header and its payload; receives are posted unchanged. Requests come back in the
        order of ``p2p_op_list``, as the real function returns them.
        """
        if not isinstance(p2p_op_list, list) or not p2p_op_list or not all(
            isinstance(op, dist.P2POp) for op in p2p_op_list
        ):
            return self._real_batch(p2p_op_list)  # raises the real, descriptive error
        group = p2p_op_list[0].group
        if any(op.group != group for op in p2p_op_list) or dist.get_rank(group) < 0:
            return self._real_batch(p2p_op_list)
        for op in p2p_op_list:
            _check_tensor(op.tensor)
        me = self._my_rank()
        parts_by_dst: dict[int, list[tuple[int, _Part]]] = {}
        works: list[dist.Work | None] = [None] * len(p2p_op_list)
        for index, op in enumerate(p2p_op_list):
            # P2POp only admits isend or irecv; irecv is never swapped, so anything else is a send
            # (the real isend, or the emulate_network wrapper, or one captured before the block).
            if op.op in (self._real_irecv, c10d.irecv, dist.irecv):
                works[index] = self._real_irecv(op.tensor, op.peer, group=op.group, tag=op.tag)
            elif op.peer == me:
                works[index] = self._real_isend(op.tensor, op.peer, group=op.group, tag=op.tag)
            else:
                parts_by_dst.setdefault(op.peer, []).append(
                    (index, _Part(_copy(op.tensor), op.group, op.group_peer, op.tag)))
        for dst, indexed_parts in parts_by_dst.items():
            message = self._submit(dst, [part for _, part in indexed_parts])
            for index, _part in indexed_parts:
                works[index] = _DeferredSendWork(message, p2p_op_list[index].tensor)
        return [work for work in works if work is not None]

    def close(self, timeout_s: float = 60.0, *, flush: bool = True) -> None:
        """Stop accepting sends, deliver the queued ones (``flush``) and join the threads.

        With ``flush=False`` queued messages are dropped (used when the job is failing anyway).
        Raises ``TimeoutError`` if the threads do not finish in ``timeout_s`` (e.g. a receiver
        never posts its receive), and ``RuntimeError`` if a deferred send failed.
        """
        with self._cond:
            self._closing = True
            self._drop = self._drop or not flush
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        self._sender.join(max(0.0, deadline - time.monotonic()))
        self._reaper.join(max(0.0, deadline - time.monotonic()))
        if self._sender.is_alive() or self._reaper.is_alive():
            raise TimeoutError(
                f"network emulator did not flush its sends within {timeout_s} s (a receiver may "
                f"never post its receive); its daemon threads stop at the per-send timeout "
                f"({self.timeout_s} s)"
            )
        if self._error is not None and flush:
            raise RuntimeError(f"network emulator: a deferred send failed: {self._error}") from self._error

    def __enter__(self) -> EmulatedNetwork:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close_after(exc is not None)

    # ----------------------------------------------------------------- internals
    def _close_after(self, failed: bool) -> None:
        if not failed:
            self.close()
            return
        # The block already raised: do not wait long for peers that may be gone, and never mask
        # the original exception with one from closing.
        try:
            self.close(timeout_s=5.0, flush=False)
        except Exception:  # logged, so the original exception is not masked
            logger.warning("network emulator: error while closing after a failure", exc_info=True)

    def _my_rank(self) -> int:
        if self._rank is None:
            self._rank = dist.get_rank()
        return self._rank

    def _submit(self, dst: int, parts: list[_Part]) -> _Message:
        src = self._my_rank()
        nbytes = sum(part.tensor.numel() * part.tensor.element_size() for part in parts)
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"network emulator failed earlier: {self._error}") from self._error
            if self._closing:
                raise RuntimeError("EmulatedNetwork is closed; send outside emulate_network() or "
                                   "create a new EmulatedNetwork")
            link = self._links.get((src, dst))
            if link is None:
                link = self._links[(src, dst)] = LinkModel(self.config, src, dst)
                self._stats[(src, dst)] = LinkStats()
            # Time and link state are taken under the lock so concurrent senders stay FIFO.
            now_s = self._clock()
            message = _Message(src, dst, parts, nbytes, now_s, link.schedule(now_s, nbytes))
            stats = self._stats[(src, dst)]
            stats.messages += 1
            stats.nbytes += nbytes
            stats.delay_s += message.deliver_s - now_s
            heapq.heappush(self._heap, (message.deliver_s, next(self._seq), message))
            self._cond.notify_all()
        return message

    def _send_loop(self) -> None:
        try:
            self._send_until_closed()
        finally:
            self._reap_queue.put(_STOP)  # after the sender's last item, so everything is reaped

    def _send_until_closed(self) -> None:
        while True:
            with self._cond:
                due: list[_Message] = []
                while not due:
                    if self._drop:
                        for _, _, message in self._heap:
                            self._fail(message, RuntimeError("dropped: network emulator closed"), log=False)
                        self._heap.clear()
                    if not self._heap and self._closing:
                        return
                    now_s = self._clock()
                    while self._heap and self._heap[0][0] <= now_s:
                        due.append(heapq.heappop(self._heap)[2])
                    if not due:
                        # Bounded wait: re-check at least once a second even without a notify.
                        wait_s = self._heap[0][0] - now_s if self._heap else 1.0
                        self._cond.wait(min(wait_s, 1.0))
            for message in due:
                self._issue(message)

    def _issue(self, message: _Message) -> None:
        if self._error is not None:  # after a failure nothing is sent (FIFO could not hold)
            self._fail(message, RuntimeError(f"not sent: earlier failure {self._error}"), log=False)
            return
        works = []
        try:
            for part in message.parts:
                work = self._send_fn(part.tensor, group=part.group, tag=part.tag, group_dst=part.group_dst)
                works.append(work)
        except Exception as exc:  # reported through wait() and close()
            self._fail(message, exc)
            return
        self._reap_queue.put((message, works))

    def _reap_loop(self) -> None:
        while True:
            try:
                item = self._reap_queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            message, works = item
            try:
                for work in works:
                    if work is not None:
                        work.wait(timeout=timedelta(seconds=self.timeout_s))
            except Exception as exc:  # reported through wait() and close()
                self._fail(message, exc)
                continue
            message.parts = []  # free the copies: the receiver has them now
            message.done.set()

    def _fail(self, message: _Message, exc: BaseException, *, log: bool = True) -> None:
        message.error = exc
        message.parts = []
        message.done.set()
        if self._error is None:
            self._error = exc
            if log:
                logger.error("network emulator: deferred %s failed: %s", message.describe(), exc)


def _check_tensor(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor to send, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise RuntimeError(
            f"varuna.testing.netem emulates CPU (gloo) transfers only, got a tensor on {tensor.device}; "
            f"unset {NETEM_ENV_VAR} / do not use emulate_network() with accelerator tensors"
        )


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    # The caller may overwrite its buffer as soon as isend returns (the request is complete), so
    # the message keeps its own copy. Cost: one memcpy on the caller's thread per send.
    return tensor.detach().clone()


# ---------------------------------------------------------------------------- process-wide swap
# See Note [Swapping torch.distributed functions] in the module docstring.
_PATCHED_NAMES = ("isend", "batch_isend_irecv")
_PATCHED_MODULES = (dist, c10d)
_patch_lock = threading.Lock()
_active: EmulatedNetwork | None = None  # the network of the active emulate_network block


def _make_wrappers(net: EmulatedNetwork) -> dict[str, Callable]:
    real_isend, real_batch = c10d.isend, c10d.batch_isend_irecv

    @functools.wraps(real_isend)  # keeps __name__ == "isend": P2POp.__repr__ looks for "send" in it
    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        if net.closed:  # a reference that outlived the block: behave like the real function
            return real_isend(tensor, dst, group=group, tag=tag, group_dst=group_dst)
        return net.isend(tensor, dst, group=group, tag=tag, group_dst=group_dst)

    @functools.wraps(real_batch)
    def batch_isend_irecv(p2p_op_list):
        if net.closed:
            return real_batch(p2p_op_list)
        return net.batch_isend_irecv(p2p_op_list)

    return {"isend": isend, "batch_isend_irecv": batch_isend_irecv}


@contextlib.contextmanager
def emulate_network(
    config: NetworkConfig | str | None, *, timeout_s: float = 300.0, close_timeout_s: float = 60.0,
) -> Iterator[EmulatedNetwork | None]:
    """Route every ``torch.distributed`` point-to-point send of this process through an emulator.

    Inside the block, ``dist.isend``, ``dist.batch_isend_irecv`` and (through ``isend``)
    ``dist.send`` deliver with the configured latency, jitter and bandwidth, for every caller in
    the process (varuna's runtime, ``torch.distributed.pipelining``, user code). On exit the
    queued messages are delivered, the threads joined and the original functions restored --
    also when the block raises. ``config=None`` (or an empty string) runs the block unchanged.
    Not re-entrant: one emulated network per process at a time. Exit the block before
    ``destroy_process_group``. See Note [Swapping torch.distributed functions].

    Example::

        dist.init_process_group("gloo")
        with emulate_network("latency=5ms,jitter=1ms,seed=1") as net:
            schedule.step(x)                        # pipelining's sends now take >= 5 ms
        print(net.link_stats())
    """
    global _active
    if isinstance(config, str):
        config = NetworkConfig.parse(config) if config.strip() else None
    if config is None:
        yield None
        return
    with _patch_lock:
        if _active is not None:
            raise RuntimeError("emulate_network() is already active in this process; it cannot be nested")
        net = EmulatedNetwork(config, timeout_s=timeout_s)
        wrappers = _make_wrappers(net)
        saved = {(module, name): getattr(module, name)
                 for module in _PATCHED_MODULES for name in _PATCHED_NAMES}
        for module in _PATCHED_MODULES:
            for name, wrapper in wrappers.items():
                setattr(module, name, wrapper)
        _active = net
    failed = True
    try:
        yield net
        failed = False
    finally:
        try:
            if failed:
                net._close_after(True)
            else:
                net.close(close_timeout_s)
        finally:
            with _patch_lock:
                for (module, name), original in saved.items():
                    setattr(module, name, original)
                _active = None
