"""Recovery without an operator on several hosts (``varuna-launch --hosts --max-restarts N``): after
a failure a restart can fix, relaunch on the hosts still reachable, planned again for what is
left, resuming from the newest checkpoint (Note [Restarts on hosts]).

Note [Restarts on hosts]
~~~~~~~~~~~~~~~~~~~~~~~~
A launch ends in a failure a restart can fix when a worker failed or a host was lost (it went
silent, or its agent vanished or could not start; Note [Silent hosts] in
:mod:`varuna.launch.protocol`), or, with ``--live-morph``, when a live morph was impossible (a
stage lost every replica). Then, at most ``--max-restarts`` times:

1. the lost hosts are left out for the rest of this launch (a host that just went silent may
   flap; probing it again would also cost the ssh connect timeout while it is still silent);
2. the remaining hosts are planned for exactly as at start (:func:`plan` is the launcher's own:
   ``--pipeline-depth`` with D as the slots hold, or auto-config, or the mixed-type planner); if
   they cannot hold the job, it fails with the reason (``cannot launch: ...``);
3. fresh agents start every worker with ``VARUNA_RESTARTS`` = the restart's number and resume
   from the newest complete checkpoint (``--checkpoint-dir``: ``VARUNA_RESUME=auto``), at the new
   P×D if it changed; in deterministic mode the weights then end bit-identical to an
   undisturbed run.

A stop signal received while the workers exited ends the job instead (no relaunch), and a
worker that could not be started is not retried (it would not start again).

Example::

    code = run_with_restarts(config, reachable, plan, ssh=ssh, stderr=sys.stderr)
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from varuna.launch.events import EventLog
from varuna.launch.hosts import HostEntry
from varuna.launch.job import ForwardedSignals, attempt_on_hosts, check_before_agents, stop_before_restart
from varuna.launch.live_store import RESTARTS_ENV
from varuna.launch.protocol import SILENCE_TIMEOUT_S
from varuna.launch.remote import RemoteStart
from varuna.launch.spec import LaunchConfig
from varuna.launch.ssh import SshOptions
from varuna.launch.supervisor import EXIT_WORKER_FAILED, PROG

__all__ = ["CannotPlace", "Placement", "run_with_restarts"]


class CannotPlace(ValueError):
    """The hosts cannot hold the job (one line: the reason and the fix): exit 1, not a usage error."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """A job planned for some hosts: what every worker runs, on which hosts, said how."""

    config: LaunchConfig
    """P×D, the run plan in ``worker_env``, ``rank_hosts`` for mixed VM types."""
    hosts: list[HostEntry]
    """The hosts used, rank 0's first."""
    line: str
    """``P=2 × D=2 on 2 host(s): a (2 workers), b (2 workers)``, said before each launch."""


def run_with_restarts(
    config: LaunchConfig,
    reachable: Sequence[HostEntry],
    plan: Callable[[list[HostEntry]], Placement],
    *,
    ssh: SshOptions | None = None,
    job_id: str | None = None,
    unreachable: Sequence[tuple[HostEntry, str]] = (),
    host_timeout_s: float = SILENCE_TIMEOUT_S,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    progress: bool | None = False,
    remote: RemoteStart | None = None,
    stop_seen: Callable[[int], None] | None = None,
) -> int:
    """Launch on ``plan(reachable)``; after a failure a restart can fix, plan again for the hosts
    not lost and relaunch, at most ``config.restart_limit`` times (Note [Restarts on hosts]).
    ``plan`` raises :class:`CannotPlace` (one line) when the hosts cannot hold the job (exit 1),
    another ``ValueError`` for a usage error (raised on the first launch; later, the hosts
    cannot hold the job either). Returns the launcher's exit code.

    ``remote`` and ``stop_seen`` are :func:`varuna.launch.job.launch_on_hosts`'s: agents started
    with srun in a Slurm allocation (``varuna-launch --slurm``), and a callback told of every stop
    signal the job got, the launcher's own or an agent's report (the caller's requeue decision)."""
    stderr = stderr if stderr is not None else sys.stderr
    limit, live = config.restart_limit, config.live_morph
    events = EventLog(config.log_dir)
    lost: list[HostEntry] = []
    left_out = list(unreachable)
    with ForwardedSignals(observe=stop_seen) as signals:
        for attempt in range(limit + 1):
            hosts = [e for e in reachable if not any(e is x for x in lost)]
            try:
                placement = plan(hosts)
            except ValueError as exc:
                if attempt == 0 and not isinstance(exc, CannotPlace):
                    raise  # a usage error (exit 2), found before anything ran
                why = f"cannot launch: {exc}" + (f" ({_names(lost)} lost)" if lost else "")
                _say(stderr, why)
                events.record("job-failed", cause=why, attempt=attempt + 1)
                return EXIT_WORKER_FAILED
            _say(stderr, placement.line)
            run_config = placement.config
            if limit or live:
                run_config = dataclasses.replace(
                    run_config, worker_env={**run_config.worker_env, RESTARTS_ENV: str(attempt)}
                )
            check_before_agents(run_config, placement.hosts)
            result = attempt_on_hosts(
                run_config, placement.hosts, signals, ssh=ssh, remote=remote, job_id=job_id,
                unreachable=left_out, host_timeout_s=host_timeout_s, stdout=stdout, stderr=stderr,
                progress=progress, events=events,
                failure_word="job failed" if attempt == limit else f"launch {attempt + 1} failed",
            )
            reason = result.restart_reason
            if not reason:
                return result.code
            stopped = stop_before_restart(signals, stderr, reason, live=live)
            if stopped is not None:
                return stopped
            lost += [e for e in result.lost if not any(e is x for x in lost)]
            left_out += [(e, "lost during the job") for e in result.lost]
            if attempt == limit:
                if live:
                    _say(stderr, f"job failed: live morph impossible ({reason}) and no restart left"
                                 f" (--max-restarts {limit})")
                events.record("job-failed", cause=reason, attempt=attempt + 1)
                return EXIT_WORKER_FAILED
            what = f"live morph impossible ({reason}); fallback: relaunching" if live else "relaunching"
            remaining = len(reachable) - len(lost)
            gone = f"; left out: {_names(lost)}" if lost else ""
            _say(stderr, f"{what} on the {remaining} host(s) left from the newest checkpoint"
                         f" (restart {attempt + 1} of {limit}){gone}")
            events.record("restart", attempt=attempt + 1, of=limit, reason=reason,
                          left_out=[e.display for e in lost], hosts=remaining)
    raise AssertionError("unreachable")  # the loop returns on its last round


def _names(entries: Sequence[HostEntry]) -> str:
    return ", ".join(e.display for e in entries)


def _say(stderr: TextIO, text: str) -> None:
    try:
        stderr.write(f"{PROG}: {text}\n")
        stderr.flush()
    except (OSError, ValueError):
        pass
