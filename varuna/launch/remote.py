"""How the launcher starts a per-host agent on a host that is not this machine: a *remote-start
method*. Two exist: OpenSSH (:class:`varuna.launch.ssh.SshOptions`, for ``--hosts``) and Slurm's
``srun`` (:class:`varuna.launch.srun.SrunOptions`, for ``--slurm``). Everything after the start —
the line protocol on the agent's stdin/stdout, heartbeats, signals, shutdown — is the same for
both (:class:`varuna.launch.agent_host.AgentHost`).

Note [Remote start]: a method turns "run ``python -m varuna.launch.agent ARGS`` on host H" into
a local argv (never a shell line: what a remote shell sees is built with ``shlex.quote``, Note [No
shell injection]) and the environment of that local client process (None: the launcher's own).
ssh forwards no environment, so its agent's ``PYTHONPATH`` goes into the remote command; srun
exports the client's environment to the task, so its agent gets the launcher's environment
(without the launcher's own variables, ``LAUNCHER_VARS``) plus ``PYTHONPATH``, as a pretend
``localhost`` agent does (:func:`agent_environ`).

Example::

    >>> agent_environ({"HOME": "/root", "VARUNA_SSH_KEY": "k"}, ["/src"])
    {'HOME': '/root', 'PYTHONPATH': '/src'}
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol

from varuna.core.env import LAUNCHER_VARS
from varuna.launch.hosts import HostEntry

__all__ = ["RemoteStart", "agent_environ"]


class RemoteStart(Protocol):
    """A way to start an agent on another host (Note [Remote start])."""

    method: str
    """Its name in messages: ``ssh``, ``srun``."""
    reports_signals: bool
    """Whether the host's scheduler signals the agent's step itself (srun): the agent then reports
    SIGUSR1/SIGTERM/SIGINT to the launcher instead of acting on them (``--report-signals``)."""

    def agent_argv(
        self, entry: HostEntry, *, python: str, pythonpath: Sequence[str], agent_args: Sequence[str]
    ) -> list[str]:
        """The local argv that runs the agent on ``entry``."""
        ...

    def agent_env(self, environ: Mapping[str, str], pythonpath: Sequence[str]) -> dict[str, str] | None:
        """The environment of that local process; None: the launcher's."""
        ...


def agent_environ(environ: Mapping[str, str], pythonpath: Sequence[str]) -> dict[str, str]:
    """``environ`` without the launcher's own variables, ``pythonpath`` first in ``PYTHONPATH``:
    the environment of an agent that inherits the launcher's (a pretend host's, an srun task's)."""
    paths = [*pythonpath, *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {k: v for k, v in environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
