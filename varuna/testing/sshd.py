"""A real OpenSSH server for tests and rigs: keys, configuration and the ``sshd`` process.

The multi-host launcher (``varuna-launch --hosts``) reaches hosts with OpenSSH; tests exercise that
path on this machine with Debian's ``/usr/sbin/sshd`` started as a child, on loopback addresses
(``tests/test_remote_launch.py``) or one per network namespace (:mod:`varuna.testing.netns`). Key
authentication only: a host key and a user key are generated into a directory of the caller's
(:meth:`SshKeys.generate`), the user key is the only authorized one, and ``known_hosts`` starts
empty (the launcher's ``StrictHostKeyChecking=accept-new`` records each host key once).

Example::

    keys = SshKeys.generate(tmp_path / "ssh")
    proc = start_sshd(keys, port=2222, listen=["127.0.0.2"], name="t")
    # varuna-launch --hosts 127.0.0.2:2222 --ssh-key keys.user_key --ssh-known-hosts keys.known_hosts ...
    stop_sshd(proc)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from varuna.core.process import PR_SET_PDEATHSIG, libc_prctl, pdeathsig_prefix

__all__ = ["SSHD", "SshKeys", "sshd_unavailable", "start_sshd", "stop_sshd"]

SSHD = "/usr/sbin/sshd"


def sshd_unavailable() -> str | None:
    """Why no test sshd can run here (one line naming the fix), or None.

    Example::

        >>> sshd_unavailable() is None or "install" in sshd_unavailable() or "root" in sshd_unavailable()
        True
    """
    if not os.path.exists(SSHD):
        return f"{SSHD} not installed (apt-get install -y openssh-server, or scripts/setup.sh --tests)"
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "the OpenSSH client (ssh, ssh-keygen) is not installed"
    if not os.path.isdir("/run/sshd"):
        # sshd insists on its privilege separation directory (the Debian package creates it at
        # boot through systemd, which containers lack).
        if os.geteuid() != 0:
            return "sshd needs /run/sshd, which only root can create here"
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    return None


@dataclass(frozen=True)
class SshKeys:
    """Host and user keys in one directory, with the files sshd and ssh are pointed at."""

    directory: Path

    @property
    def host_key(self) -> Path:
        return self.directory / "host_key"

    @property
    def user_key(self) -> Path:
        """The private key the launcher uses (``--ssh-key``)."""
        return self.directory / "user_key"

    @property
    def authorized_keys(self) -> Path:
        return self.directory / "authorized_keys"

    @property
    def known_hosts(self) -> Path:
        """Where the launcher records host keys (``--ssh-known-hosts``)."""
        return self.directory / "known_hosts"

    def launcher_args(self) -> list[str]:
        """``varuna-launch`` options that use these keys."""
        return ["--ssh-key", str(self.user_key), "--ssh-known-hosts", str(self.known_hosts)]

    @classmethod
    def generate(cls, directory: Path) -> SshKeys:
        """Make ``directory`` and fresh ed25519 host and user keys in it."""
        directory.mkdir(parents=True, exist_ok=True)
        keys = cls(directory)
        for path in (keys.host_key, keys.user_key):
            if not path.exists():
                subprocess.run(
                    ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
                    check=True, capture_output=True, timeout=30,
                )
        keys.authorized_keys.write_text(Path(f"{keys.user_key}.pub").read_text())
        return keys


def _config(keys: SshKeys, *, port: int, listen: Sequence[str], name: str) -> str:
    # ClientAlive*: a session whose client went silent ends after 6-8 s, as the launcher's side
    # does (ServerAlive*, varuna/launch/ssh.py). Without it the per-connection sshd of a host cut
    # off for a minute waits on TCP's retransmission back-off (another minute or more after the
    # link heals) while the job's processes there are long gone: a leftover the chaos runs saw.
    listen_lines = "\n".join(f"ListenAddress {a}" for a in listen)
    return textwrap.dedent(
        f"""\
        Port {port}
        HostKey {keys.host_key}
        AuthorizedKeysFile {keys.authorized_keys}
        PidFile {keys.directory / f"sshd-{name}.pid"}
        StrictModes no
        UsePAM no
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PermitRootLogin prohibit-password
        MaxStartups 50
        ClientAliveInterval 2
        ClientAliveCountMax 3
        """
    ) + listen_lines + "\n"


def _die_with_parent() -> None:
    prctl = libc_prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)


def start_sshd(
    keys: SshKeys, *, port: int, listen: Sequence[str] = (), name: str = "sshd",
    wrap: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Start ``sshd -D`` (a child of this process that dies with it) for ``keys``; ``listen``:
    its addresses (empty: every address), ``wrap``: a command prefix such as ``ip netns exec NS``.
    Its log is ``keys.directory / f"sshd-{name}.log"``. The caller waits until it listens."""
    path = keys.directory / f"sshd-{name}.conf"
    path.write_text(_config(keys, port=port, listen=listen, name=name))
    argv = [*wrap, SSHD, "-D", "-e", "-f", str(path)]
    # A killed test takes its sshd with it (parent-death signal). setpriv sets it without Python
    # between fork and exec: a preexec_fn in a test process that used the manager's gRPC client
    # can crash the child in gRPC's fork handler (varuna/core/process.py; seen: "sshd of host 2
    # did not start: ... epoll_wait error: Bad file descriptor").
    prefix = pdeathsig_prefix()
    with open(keys.directory / f"sshd-{name}.log", "wb") as log:
        return subprocess.Popen([*prefix, *argv], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                preexec_fn=None if prefix else _die_with_parent)


def stop_sshd(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
