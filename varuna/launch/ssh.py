"""OpenSSH for a multi-host job: the ``ssh`` argv (:class:`SshOptions`, key authentication
only), the quoted command that starts an agent on a remote host (:func:`remote_agent_command`,
Note [No shell injection] in :mod:`varuna.launch.hosts`), and the reachability probe that runs
before a job is placed (:func:`probe_hosts`).

Example::

    >>> from varuna.launch.hosts import parse_host_entry
    >>> SshOptions().argv(parse_host_entry("bob@h1"), "true")[-4:]
    ['bob', '--', 'h1', 'true']
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from varuna.launch.hosts import HostEntry
from varuna.launch.procs import pdeathsig_preexec

__all__ = ["SshOptions", "probe_hosts", "remote_agent_command", "validate_remote_path"]


def validate_remote_path(path: str, what: str) -> str:
    """An absolute path without control characters, fit to go (quoted) into a remote command.

    Example::

        >>> validate_remote_path("/opt/venv/bin/python", "python")
        '/opt/venv/bin/python'
    """
    if not os.path.isabs(path):
        raise ValueError(f"{what} {path!r} must be an absolute path (it is used on other hosts)")
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ValueError(f"{what} {path!r} contains control characters")
    return path


@dataclass(frozen=True, kw_only=True)
class SshOptions:
    """How to reach ssh hosts. Key authentication only (``BatchMode``): a password prompt
    would hang a non-interactive launch.

    Example::

        >>> from varuna.launch.hosts import parse_host_entry
        >>> argv = SshOptions(connect_timeout_s=5).argv(parse_host_entry("bob@h1:2222"), "true")
        >>> argv[0], argv[-3:], "-p" in argv and "2222" in argv
        ('ssh', ['--', 'h1', 'true'], True)
    """

    key_file: str | None = None
    """Private key (``-i``); None uses ssh's defaults and agent."""
    known_hosts_file: str | None = None
    """``UserKnownHostsFile`` to use instead of ``~/.ssh/known_hosts``; new host keys are
    accepted and recorded there (``accept-new``), changed ones refused."""
    connect_timeout_s: float = 10.0
    """``ConnectTimeout``; also bounds the reachability probe."""
    ssh: str = "ssh"
    """The ssh client."""
    method: ClassVar[str] = "ssh"
    reports_signals: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for what, path in (("--ssh-key", self.key_file), ("--ssh-known-hosts", self.known_hosts_file)):
            # ssh splits UserKnownHostsFile at whitespace and expands %-tokens in both options.
            if path is not None and (any(c.isspace() for c in path) or "%" in path):
                raise ValueError(f"{what} {path!r} may not contain whitespace or '%'")
        if not math.isfinite(self.connect_timeout_s) or self.connect_timeout_s <= 0:
            raise ValueError(f"--ssh-connect-timeout must be > 0, got {self.connect_timeout_s}")

    def argv(self, entry: HostEntry, remote_command: str) -> list[str]:
        """The local ``ssh`` argv that runs ``remote_command`` on ``entry`` (no pty: the agent's
        stdin/stdout are a clean byte channel and the escape character is off)."""
        argv = [
            self.ssh,
            "-T",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            f"ConnectTimeout={max(1, round(self.connect_timeout_s))}",
            # A backstop behind the agent's own beats (Note [Silent hosts] in protocol.py: the
            # launcher names a silent host after --host-timeout, 4 s): the client gives up on a
            # silent server 6-8 s into the silence and exits.
            "-o",
            "ServerAliveInterval=2",
            "-o",
            "ServerAliveCountMax=3",
            # No "Permanently added ... to the list of known hosts" noise in the job's output.
            "-o",
            "LogLevel=ERROR",
        ]
        if self.known_hosts_file is not None:
            argv += ["-o", f"UserKnownHostsFile={self.known_hosts_file}"]
        if self.key_file is not None:
            argv += ["-i", self.key_file, "-o", "IdentitiesOnly=yes"]
        if entry.port is not None:
            argv += ["-p", str(entry.port)]
        if entry.user is not None:
            argv += ["-l", entry.user]
        return [*argv, "--", entry.host, remote_command]


    def agent_argv(
        self, entry: HostEntry, *, python: str, pythonpath: Sequence[str], agent_args: Sequence[str]
    ) -> list[str]:
        """``ssh ... HOST 'exec env PYTHONPATH=... python -m varuna.launch.agent ...'`` (the
        remote-start method of ``--hosts``, Note [Remote start] in :mod:`varuna.launch.remote`)."""
        command = remote_agent_command(python=python, pythonpath=pythonpath, agent_args=agent_args)
        return self.argv(entry, command)

    def agent_env(self, environ: Mapping[str, str], pythonpath: Sequence[str]) -> dict[str, str] | None:
        """None: ssh forwards no environment (``PYTHONPATH`` is in the remote command)."""
        return None


def remote_agent_command(*, python: str, pythonpath: Sequence[str], agent_args: Sequence[str]) -> str:
    """The command string the remote login shell runs to start an agent; every piece is
    ``shlex.quote``-d (Note [No shell injection]).

    Example::

        >>> remote_agent_command(python="/usr/bin/python3", pythonpath=["/src/my repo"],
        ...                      agent_args=["--job-id", "j1"])
        "exec env 'PYTHONPATH=/src/my repo' /usr/bin/python3 -m varuna.launch.agent --job-id j1"
    """
    python = validate_remote_path(python, "python interpreter")
    for entry in pythonpath:
        validate_remote_path(entry, "PYTHONPATH entry")
    pieces = ["exec", "env"]
    if pythonpath:
        pieces.append("PYTHONPATH=" + os.pathsep.join(pythonpath))
    pieces += [python, "-m", "varuna.launch.agent", *agent_args]
    return " ".join(shlex.quote(p) for p in pieces)


def probe_hosts(
    entries: Sequence[HostEntry], ssh: SshOptions
) -> tuple[list[HostEntry], list[tuple[HostEntry, str]]]:
    """Which ssh hosts answer ``ssh HOST true`` within the connect timeout (all in parallel).

    Returns ``(reachable, [(unreachable entry, reason)])``, both in input order; pretend local
    hosts are always reachable. Must run in a thread that outlives the probes (parent-death
    signal, Note [No orphans] in :mod:`varuna.launch.procs`).
    """
    started: dict[int, subprocess.Popen[bytes]] = {}
    failed: dict[int, str] = {}
    try:
        for index, entry in enumerate(entries):
            if entry.is_local:
                continue
            try:
                started[index] = subprocess.Popen(
                    ssh.argv(entry, "true"),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # a Ctrl-C of the launcher must not kill it mid-probe
                    preexec_fn=pdeathsig_preexec(),
                    close_fds=True,
                )
            except OSError as exc:
                failed[index] = f"cannot run {ssh.ssh}: {exc}"
        deadline = time.monotonic() + ssh.connect_timeout_s + 5.0
        for index, proc in started.items():
            try:
                _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed[index] = f"no answer within {ssh.connect_timeout_s + 5.0:g} s"
                continue
            if proc.returncode != 0:
                lines = err.decode("utf-8", errors="replace").strip().splitlines()
                failed[index] = lines[-1] if lines else f"ssh exited with code {proc.returncode}"
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reachable = [e for i, e in enumerate(entries) if i not in failed]
    unreachable = [(entries[i], failed[i]) for i in sorted(failed)]
    return reachable, unreachable
