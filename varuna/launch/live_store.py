"""The rendezvous store of a live-morph job (``varuna-launch --live-morph``), hosted by the
launcher so that it outlives every worker (docs/live_morph.md, Protocol): workers join it as
clients (``$VARUNA_LIVE_STORE``), and the supervisor writes there that a worker is dead when it
sees the exit, so the survivors stop waiting for it at once.

Example::

    >>> with LiveStore() as store:  # doctest: +SKIP
    ...     env = {"VARUNA_LIVE_STORE": store.address}
    ...     store.declare_dead(3)
"""

from __future__ import annotations

import socket
from datetime import timedelta
from types import TracebackType
from typing import Any

__all__ = ["LIVE_JOIN_ENV", "LIVE_NOTICE_ENV", "LIVE_STORE_ENV", "RESTARTS_ENV", "LiveStore"]

#: Where workers find the store (``varuna.runtime.live_morph.LIVE_STORE_ENV``).
LIVE_STORE_ENV = "VARUNA_LIVE_STORE"
#: Set to ``1`` for a worker added to a running job (growth; ``varuna.runtime.live_morph.LIVE_JOIN_ENV``).
LIVE_JOIN_ENV = "VARUNA_LIVE_JOIN"
#: The signal (a name, e.g. ``SIGUSR2``) by which a supervisor tells one worker that its VM goes
#: away soon: hand over and leave (``LiveTrainer(notice_signals=...)``). Set by ``varuna-manager``,
#: whose SIGUSR1 stays the graceful stop of the whole job.
LIVE_NOTICE_ENV = "VARUNA_LIVE_NOTICE_SIGNAL"
#: How many times the launcher restarted the job from a checkpoint (0 on the first launch).
RESTARTS_ENV = "VARUNA_RESTARTS"


class LiveStore:
    """A ``torch.distributed.TCPStore`` server on ``host`` (a free port), for one launch of the job.

    The listening socket is bound to ``host`` only (not every interface, as a TCPStore given just a
    port would): the store is unauthenticated, like torchrun's c10d store.

    Example::

        >>> store = LiveStore(); store.address.startswith("127.0.0.1:")  # doctest: +SKIP
        True
        >>> store.close()  # doctest: +SKIP
    """

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 60.0) -> None:
        # torch only for live-morph jobs: the plain launcher starts without loading it.
        import torch.distributed as dist

        family, kind, proto, _, where = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(where)
            sock.listen(128)
            port = sock.getsockname()[1]
            self._store: dist.TCPStore | None = dist.TCPStore(
                host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                master_listen_fd=sock.fileno(),
            )
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns the descriptor now and closes it with its last handle
        self.address = f"{host}:{port}"

    @property
    def store(self) -> Any:
        """The server's own client (a ``torch.distributed.Store``)."""
        if self._store is None:
            raise RuntimeError("the live store is closed")
        return self._store

    def declare_dead(self, rank: int) -> None:
        """Tell the survivors that worker ``rank`` (its live-morph member id) is gone."""
        from varuna.runtime.live_morph import declare_dead

        if self._store is None:
            raise RuntimeError("the live store is closed")
        declare_dead(self._store, rank)

    def frozen(self, rank: int) -> str | None:
        """Why the workers declared ``rank`` dead while its process may still run (no heartbeat:
        frozen or hung), else None (Note [Live watch] in varuna/runtime/live_watch.py)."""
        from varuna.runtime.live_watch import frozen_verdict

        if self._store is None:
            return None
        return frozen_verdict(self._store, rank)

    def close(self) -> None:
        """Stop serving (the server thread ends with the last handle)."""
        self._store = None

    def __enter__(self) -> LiveStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
