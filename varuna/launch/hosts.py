"""The hosts of a multi-host job: host files and ``--hosts`` lists, their validation, slot
counts, and which hosts a job uses (:func:`select_hosts`).

A host file has one host per line, ``#`` starts a comment::

    # user@host:port  slots=N  type=NAME      (user, port, slots and type are optional)
    localhost slots=2
    10.0.0.5
    alice@gpu-7.example.com:2222 slots=4 type=v100

``type=NAME`` says which VM type the host is (issue #19, mixed VM types): either every host has a
type or none. With types, ``varuna-launch`` places the ranks so that the mixed plan's stage→type
map holds and tells the workers each replica's share and each stage's speed
(:mod:`varuna.launch.mixed`).

``--hosts`` also takes the same entries comma-separated (``localhost,10.0.0.5:2222``). A plain
``localhost`` entry is a *pretend host*: its agent is started directly, without ssh, so a
multi-host job can run on one machine (each such line is a separate host). Every other entry is
reached over OpenSSH, key authentication only (:mod:`varuna.launch.ssh`).

Note [No shell injection]: a host entry ends up in two places, the local ``ssh`` argv (a list,
never ``shell=True``) and, for the agent's command line, the remote login shell. Entries are
validated with strict patterns before anything runs (host names per RFC 1123, IPv4/IPv6
literals, POSIX-style user names, numeric ports), so ``localhost;touch /tmp/pwned`` is an error
naming the entry. The remote command string is built by
:func:`varuna.launch.ssh.remote_agent_command` with ``shlex.quote`` on every piece, and it
carries no user data besides interpreter and path names: the worker's argv, environment and
working directory travel as JSON on the agent's stdin, where no shell ever parses them.

Example::

    >>> [e.display for e in parse_hosts_arg("localhost,bob@10.0.0.5:2222 slots=2")]
    ['localhost', 'bob@10.0.0.5:2222']
    >>> parse_hosts_arg("localhost;touch /tmp/pwned")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: host entry 'localhost;touch /tmp/pwned' (--hosts entry 1): ...
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = [
    "LOCALHOST",
    "HostEntry",
    "assign_slots",
    "check_types",
    "parse_host_entry",
    "parse_host_file",
    "parse_hosts_arg",
    "select_hosts",
]

# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
# POSIX portable user names (plus upper case); no "$", no shell metacharacters.
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
# [user@](name | IPv4 | [IPv6])[:port]; each part is validated further below.
_ENTRY_RE = re.compile(r"^(?:(?P<user>[^@\s]+)@)?(?P<host>\[[^\]\s]*\]|[^:@\s\[\]]+)(?::(?P<port>[^:\s]*))?$")
_SLOTS_RE = re.compile(r"^slots=(?P<n>[0-9]+)$")
_FORM = "[user@]host[:port] [slots=N] [type=NAME]"

# Same as varuna.launch.mixed.TYPE_NAME_RE (kept here: this module imports nothing of the launcher).
_TYPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

LOCALHOST = "localhost"


@dataclass(frozen=True, kw_only=True)
class HostEntry:
    """One validated line of a host file.

    Example::

        >>> e = parse_host_entry("alice@10.0.0.5:2222 slots=4")
        >>> (e.user, e.host, e.port, e.slots, e.is_local, e.display)
        ('alice', '10.0.0.5', 2222, 4, False, 'alice@10.0.0.5:2222')
    """

    host: str
    """Host name or IP literal (IPv6 without brackets); ``localhost`` alone is a pretend host."""
    user: str | None = None
    """Login name; None lets ssh choose (the current user or ``~/.ssh/config``)."""
    port: int | None = None
    """ssh port; None lets ssh choose (22 or ``~/.ssh/config``)."""
    slots: int | None = None
    """How many workers the host runs; None means ``--procs-per-host``."""
    vm_type: str | None = None
    """The host's VM type (``type=NAME``); None when the host file does not say."""
    origin: str = ""
    """Where the entry was written (``hosts.txt line 3``), for error messages."""
    addr: str | None = None
    """Address other hosts reach this one at when it is not ``host`` (a Slurm node's
    ``NodeAddr``); None: the host name itself."""

    @property
    def is_local(self) -> bool:
        """A pretend host on this machine: its agent starts without ssh."""
        return self.host == LOCALHOST and self.user is None and self.port is None

    @property
    def address(self) -> str:
        """Address other hosts reach this one at (a pretend host is loopback)."""
        if self.addr is not None:
            return self.addr
        return "127.0.0.1" if self.is_local else self.host

    @property
    def display(self) -> str:
        """``user@host:port`` as written (IPv6 in brackets), without the slot count."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port is not None else ""
        return f"{user}{host}{port}"


def _bad(text: str, origin: str, why: str) -> ValueError:
    where = f" ({origin})" if origin else ""
    return ValueError(f"host entry {text!r}{where}: {why}")


def _validate_host(host: str, text: str, origin: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise _bad(text, origin, f"{host} is not an IPv6 address") from None
    if len(host) > 253 or not _HOSTNAME_RE.match(host):
        raise _bad(
            text,
            origin,
            "not a valid host name or IP address (letters, digits, '-' and '.' only;"
            f" write {_FORM})",
        )
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _bad(text, origin, f"{host} is not an IPv4 address") from None
    return host


def parse_host_entry(text: str, *, origin: str = "") -> HostEntry:
    """Parse and validate ``[user@]host[:port] [slots=N] [type=NAME]``; ``ValueError`` names the entry.

    Example::

        >>> parse_host_entry("[::1]:22").host
        '::1'
        >>> parse_host_entry("bad$user@h")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: host entry 'bad$user@h': user name 'bad$user' is not valid ...
    """
    tokens = text.split()
    if not tokens:
        raise _bad(text, origin, "empty entry")
    match = _ENTRY_RE.match(tokens[0])
    if match is None:
        raise _bad(text, origin, f"expected {_FORM}")
    user, host, port_text = match.group("user"), match.group("host"), match.group("port")
    if user is not None and not _USER_RE.match(user):
        raise _bad(text, origin, f"user name {user!r} is not valid (letters, digits, '_', '.', '-')")
    host = _validate_host(host, text, origin)
    port: int | None = None
    if port_text is not None:
        if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 0 < int(port_text) < 65536:
            raise _bad(text, origin, f"port {port_text!r} is not a TCP port (1..65535)")
        port = int(port_text)
    slots, vm_type = _parse_options(tokens[1:], text, origin)
    return HostEntry(host=host, user=user, port=port, slots=slots, vm_type=vm_type, origin=origin)


def _parse_options(tokens: Sequence[str], text: str, origin: str) -> tuple[int | None, str | None]:
    """``slots=N`` and ``type=NAME`` after the host, each at most once."""
    slots: int | None = None
    vm_type: str | None = None
    for token in tokens:
        key, sep, value = token.partition("=")
        if not sep or key not in ("slots", "type"):
            raise _bad(text, origin, f"unexpected {token!r}; only slots=N and type=NAME may follow the host")
        if key == "type":
            if vm_type is not None:
                raise _bad(text, origin, "type= given twice")
            if not _TYPE_RE.match(value):
                why = f"type {value!r} is not a VM type name (1-64 letters, digits, '_', '.', '-')"
                raise _bad(text, origin, why)
            vm_type = value
            continue
        slot_match = _SLOTS_RE.match(token)
        if slot_match is None:
            raise _bad(text, origin, f"slots {value!r} is not a whole number; write slots=N")
        if slots is not None:
            raise _bad(text, origin, "slots= given twice")
        slots = int(slot_match.group("n"))
        if slots < 1:
            raise _bad(text, origin, "slots must be >= 1")
    return slots, vm_type


def check_types(entries: Sequence[HostEntry]) -> bool:
    """Whether the hosts say their VM types; ``ValueError`` (one line) when only some do.

    Example::

        >>> check_types(parse_hosts_arg("a type=x,b type=y"))
        True
        >>> check_types(parse_hosts_arg("a type=x,b"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: host entry 'b' (--hosts entry 2) has no type= but other hosts do; ...
    """
    typed = [e for e in entries if e.vm_type is not None]
    if not typed:
        return False
    untyped = next((e for e in entries if e.vm_type is None), None)
    if untyped is not None:
        raise ValueError(
            f"host entry {untyped.display!r} ({untyped.origin}) has no type= but other hosts do;"
            " give type=NAME on every host or on none"
        )
    return True


def parse_host_file(path: str | os.PathLike[str]) -> list[HostEntry]:
    """Entries of a host file (one per line, ``#`` comments, blank lines ignored).

    Example::

        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        ...     _ = f.write("# two pretend hosts\\nlocalhost slots=2\\nlocalhost  # again\\n")
        >>> [(e.host, e.slots) for e in parse_host_file(f.name)]
        [('localhost', 2), ('localhost', None)]
    """
    entries = []
    name = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            text = line.split("#", 1)[0].strip()
            if text:
                entries.append(parse_host_entry(text, origin=f"{name} line {lineno}"))
    if not entries:
        raise ValueError(f"host file {name} lists no hosts; write one {_FORM} per line")
    return entries


def parse_hosts_arg(arg: str) -> list[HostEntry]:
    """``--hosts``: an existing file is a host file, anything else a comma-separated list."""
    if os.path.isfile(arg):
        return parse_host_file(arg)
    entries = []
    for index, text in enumerate(arg.split(","), start=1):
        text = text.strip()
        if not text:
            raise _bad(arg, "--hosts", f"entry {index} is empty")
        try:
            entries.append(parse_host_entry(text, origin=f"--hosts entry {index}"))
        except ValueError as exc:
            if os.sep in arg and "," not in arg:
                # Most likely a mistyped file name rather than a host.
                raise ValueError(f"{exc}; and no host file {arg!r} exists") from None
            raise
    return entries


def assign_slots(entries: Sequence[HostEntry], procs_per_host: int | None) -> list[HostEntry]:
    """Give entries without ``slots=`` the ``--procs-per-host`` count.

    Example::

        >>> [e.slots for e in assign_slots(parse_hosts_arg("a slots=4,b"), 2)]
        [4, 2]
    """
    if procs_per_host is not None and procs_per_host < 1:
        raise ValueError(f"--procs-per-host must be >= 1, got {procs_per_host}")
    out = []
    for entry in entries:
        if entry.slots is None:
            if procs_per_host is None:
                raise ValueError(
                    f"host entry {entry.display!r} ({entry.origin}) has no slots=N; give --procs-per-host K"
                    " or slots=N on every host"
                )
            entry = replace(entry, slots=procs_per_host)
        out.append(entry)
    return out


def select_hosts(entries: Sequence[HostEntry], world_size: int) -> list[HostEntry]:
    """The first hosts, in order, whose slots hold ``world_size`` workers (Note [Rank layout]).

    Example::

        >>> [e.display for e in select_hosts(parse_hosts_arg("a slots=2,b slots=2,c slots=2"), 3)]
        ['a', 'b']
    """
    used: list[HostEntry] = []
    capacity = 0
    for entry in entries:
        if capacity >= world_size:
            break
        used.append(entry)
        capacity += entry.slots or 0
    return used
