"""The shared pool's state in the manager's one SQLite file (docs/pool.md), so a restarted
manager carries on with the same allocation, round counters, measured corrections and placements.

Two tables (schema version 3 of :mod:`manager.domain.store`, which creates them): ``pool_state`` holds
the pool-wide values (the config, the round index and when the next round is due, the round
scheduler's counters), ``pool_jobs`` one row per pool job (its placement, allocation, predicted
and measured throughput, correction factors and measured morph time). The manager keeps the
state in memory and writes it whole after every round (a few rows: one transaction).

    >>> s = PoolState(round_index=2, next_round_at=10.0)
    >>> s.jobs["a"] = PoolJobState(vm_type="x", vm_ids=["x-0"], factors={"x": 0.9})
    >>> PoolState.from_json(s.to_json()) == s
    True
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

__all__ = ["POOL_SCHEMA", "PoolJobState", "PoolState", "PoolStore"]

POOL_SCHEMA = """
CREATE TABLE IF NOT EXISTS pool_state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pool_jobs (
    job_id TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


@dataclass
class PoolJobState:
    """One pool job: where the last round put it and what the pool knows of it."""

    vm_type: str = ""
    """"" = not placed (waiting, paused)."""
    vm_ids: list[str] = field(default_factory=list)
    """The pool slots it holds (``type-i``); their count is its VM count."""
    allocation: dict[str, float] = field(default_factory=dict)
    """The policy's time fractions, ``"type×count" -> y``."""
    predicted: float = 0.0
    """The corrected matrix rate on its placement, examples/s."""
    measured: float = 0.0
    """Its latest measured rate on its placement, examples/s (0 = none yet)."""
    factors: dict[str, float] = field(default_factory=dict)
    """Measured/predicted correction per VM type (Note [Measured correction])."""
    morph_s: float = 0.0
    """Its latest measured morph latency (0 = none yet: the config's default)."""
    received: dict[str, int] = field(default_factory=dict)
    """Rounds run per configuration ``"type×count"`` (RoundScheduler's counters)."""
    age: int = 0
    """Rounds in the pool."""
    round_index: int = -1
    """The round that placed it."""

    @property
    def count(self) -> int:
        return len(self.vm_ids)


@dataclass
class PoolState:
    """Everything the pool keeps between rounds."""

    round_index: int = 0
    """Rounds run so far."""
    next_round_at: float = 0.0
    """Clock time the next round is due (0: at once)."""
    jobs: dict[str, PoolJobState] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PoolState:
        d = json.loads(text)
        jobs = {j: PoolJobState(**v) for j, v in d.pop("jobs", {}).items()}
        return cls(**d, jobs=jobs)


class _Transactional(Protocol):
    def transaction(self) -> Any: ...


class PoolStore:
    """Reads and writes :class:`PoolState` and the pool's config in the store's file.

    Example::

        ps = PoolStore(store)
        config_json, state = ps.load()      # ("", PoolState()) on a fresh file
        ps.save(config_json, state)
    """

    def __init__(self, store: _Transactional) -> None:
        self.store = store

    def load(self) -> tuple[str, PoolState]:
        """The stored config (JSON, "" when none) and state."""
        with self.store.transaction() as conn:
            rows = dict(conn.execute("SELECT key, value FROM pool_state").fetchall())
            jobs = conn.execute("SELECT job_id, value FROM pool_jobs").fetchall()
        state = PoolState(
            round_index=int(rows.get("round_index", "0")),
            next_round_at=float(rows.get("next_round_at", "0")),
            jobs={job_id: PoolJobState(**json.loads(value)) for job_id, value in jobs},
        )
        return rows.get("config", ""), state

    def save(self, config_json: str, state: PoolState) -> None:
        """Replace the stored pool state with ``state`` (one transaction)."""
        with self.store.transaction() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO pool_state VALUES (?, ?)",
                [
                    ("config", config_json),
                    ("round_index", str(state.round_index)),
                    ("next_round_at", repr(state.next_round_at)),
                ],
            )
            conn.execute("DELETE FROM pool_jobs")
            conn.executemany(
                "INSERT INTO pool_jobs VALUES (?, ?)",
                [(j, json.dumps(asdict(s), sort_keys=True)) for j, s in sorted(state.jobs.items())],
            )
