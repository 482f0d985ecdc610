"""``varuna-manager serve``: the gRPC server around a :class:`~manager.domain.controller.Manager`.

The server authenticates every call with :class:`~manager.transport.auth.TokenInterceptor` (and
TLS when ``tls_cert``/``tls_key`` are given), converts each request to the domain's messages and
each answer back (:mod:`manager.transport.convert`), maps a refusal's
:class:`~manager.domain.errors.ErrorKind` to its gRPC status code, and runs the manager's control
loop. Stopping it (SIGTERM/SIGINT) leaves VMs and
workers running: they keep training, and a manager started again on the same ``--db`` resumes.
"""

from __future__ import annotations

import errno
import os
import socket
import sqlite3
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from manager.common.daemon_lock import DaemonLock
from manager.common.descriptors import dashboard_connections, soft_limit
from manager.common.wire import load_token
from manager.domain.context import ManagerConfig
from manager.domain.controller import Manager
from manager.domain.errors import ErrorKind, ManagerError
from manager.domain.pool_config import PoolConfig
from manager.domain.store import Store
from manager.transport import convert
from manager.transport import varuna_manager_pb2 as pb
from manager.transport import varuna_manager_pb2_grpc as pb_grpc
from manager.transport.auth import TokenInterceptor, server_credentials
from varuna.core.extras import MissingExtra, require_extra
from varuna.launch.procs import is_loopback

if TYPE_CHECKING:
    from manager.dashboard.web import DashboardServer

__all__ = ["MAX_MESSAGE_BYTES", "STATUS_OF_ERROR", "ManagerServer", "ServeConfig", "insecure_listen_warning"]

#: Largest request the server takes (agents keep calibration files below it:
#: ``manager.agent.calibrate.MAX_CALIBRATION_BYTES``).
MAX_MESSAGE_BYTES = 16 << 20

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """``varuna-manager serve`` options."""

    db: str
    """SQLite state file (created when missing)."""
    listen: str = "127.0.0.1:7878"
    """``host:port`` to bind; port 0 picks a free one."""
    token_file: str
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    """CA certificate agents and workers verify the manager with; default ``tls_cert`` (right for
    a self-signed certificate)."""
    advertise: str | None = None
    """Address agents and workers use; default: the bound address (the host name when bound
    to all interfaces)."""
    state_dir: str | None = None
    """Local-provider VM directories; default: ``<db>.d`` next to the state file."""
    dashboard: str | None = None
    """``host:port`` of the read-only web dashboard (port 0: any free one); None: no dashboard."""
    dashboard_timeout_s: float = 10.0
    """A dashboard connection is closed when a request's headers or body take longer than this,
    or when it stays idle that long (Note [Dashboard limits] in manager/dashboard/web.py)."""
    dashboard_max_connections: int = 256
    """Dashboard connections held at once (fewer when the descriptor limit is low:
    ``manager.common.descriptors.dashboard_connections``)."""
    max_workers: int = 32
    """gRPC handler threads (each heartbeat holds one for a few milliseconds)."""
    manager: dict[str, Any] = field(default_factory=dict)
    """Overrides of :class:`ManagerConfig` fields (heartbeat timeout, stutter rule, ...)."""
    pool: PoolConfig | None = None
    """The shared pool (``--pool``, docs/pool.md); None: none, or the one stored in ``db``."""


#: The wire's status for each way the domain refuses a request (the domain never sees these).
STATUS_OF_ERROR = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}


class _Servicer(pb_grpc.VarunaManagerServicer):
    """Thin adapter: convert the request, call the manager, convert the answer, map a refusal to
    its status code."""

    def __init__(self, manager: Manager) -> None:
        self.m = manager

    @staticmethod
    def _guard(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except ManagerError as exc:
            context.abort(STATUS_OF_ERROR[exc.kind], exc.message)
        except Exception as exc:  # a bug: say so instead of dropping the connection
            traceback.print_exc(file=sys.stderr)
            context.abort(grpc.StatusCode.INTERNAL, f"manager error: {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable: abort raises")

    def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.SubmitJobReply:
        job_id = self._guard(context, lambda: self.m.submit(*convert.submission_from_pb(request.spec)))
        return pb.SubmitJobReply(job_id=job_id)

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusReply:
        jobs = self._guard(context, lambda: self.m.status(request.job_id, request.history or 20))
        return pb.GetStatusReply(jobs=[convert.status_to_pb(j) for j in jobs])

    def ListEvents(self, request: pb.ListEventsRequest, context: grpc.ServicerContext) -> pb.ListEventsReply:
        events = self._guard(context, lambda: self.m.events(request.job_id, request.after_id, request.limit))
        return pb.ListEventsReply(events=[convert.event_to_pb(e) for e in events])

    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.CancelJobReply:
        return pb.CancelJobReply(state=self._guard(context, lambda: self.m.cancel(request.job_id)))

    def RegisterVM(self, request: pb.RegisterVMRequest, context: grpc.ServicerContext) -> pb.RegisterVMReply:
        reply = self._guard(context, lambda: self.m.register_vm(convert.register_from_pb(request)))
        return convert.registered_to_pb(reply)

    def VMHeartbeat(
        self, request: pb.VMHeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.VMHeartbeatReply:
        orders = self._guard(context, lambda: self.m.vm_heartbeat(convert.heartbeat_from_pb(request)))
        return pb.VMHeartbeatReply(orders=convert.orders_to_pb(orders))

    def ReportCalibration(
        self, request: pb.ReportCalibrationRequest, context: grpc.ServicerContext
    ) -> pb.ReportCalibrationReply:
        reply = self._guard(context, lambda: self.m.report_calibration(convert.report_from_pb(request)))
        return convert.report_reply_to_pb(reply)

    def WorkerHeartbeat(
        self, request: pb.WorkerHeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.WorkerHeartbeatReply:
        ok = self._guard(context, lambda: self.m.worker_heartbeat(convert.worker_heartbeat_from_pb(request)))
        return pb.WorkerHeartbeatReply(ok=ok)


class ManagerServer:
    """Store + manager + gRPC server. ``start()`` binds and starts everything; ``stop()`` stops
    the server and the control loop (bounded waits) and closes the store.

    Example::

        server = ManagerServer(ServeConfig(db="state.sqlite", listen="127.0.0.1:0", token_file="tok"))
        server.start(); print(server.address); ...; server.stop()
    """

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        token = load_token(config.token_file)  # ValueError: one line for the CLI
        if bool(config.tls_cert) != bool(config.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        self._creds = server_credentials(config.tls_cert, config.tls_key) if config.tls_cert else None
        host, sep, port = config.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"--listen {config.listen!r} is not HOST:PORT (port 0: any free port)")
        self._host = host
        if config.advertise:
            a_host, a_sep, a_port = config.advertise.rpartition(":")
            if not a_sep or not a_host or not a_port.isdigit() or not 0 < int(a_port) < 65536:
                raise ValueError(f"--advertise {config.advertise!r} is not HOST:PORT")
        self._dashboard_at = _dashboard_address(config.dashboard) if config.dashboard else None
        self._lock = _lock_state_file(config.db)
        try:
            _check_writable_dir(config.state_dir or f"{config.db}.d", "--state-dir")
        except OSError:
            self._lock.release()
            raise
        try:
            self.store = Store(config.db)
        except (OSError, sqlite3.Error) as exc:
            self._lock.release()
            raise OSError(f"cannot open the state file {config.db}: {exc}") from None
        except ValueError:  # another application's file, a newer schema: one line, exit 2
            self._lock.release()
            raise
        self._server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=config.max_workers, thread_name_prefix="varuna-manager-rpc"
            ),
            interceptors=[TokenInterceptor(token)],
            options=[
                ("grpc.so_reuseport", 0),  # a second manager on the same port must fail, not share it
                # Calibration files come back in ReportCalibration (tens of KB; big models more).
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self.port = 0
        self._token = token
        self.manager: Manager | None = None
        self.dashboard: DashboardServer | None = None
        """The read-only dashboard once started (``dashboard`` set; aiohttp is imported then)."""
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        """``host:port`` actually bound."""
        return f"{self._host}:{self.port}"

    @property
    def failure(self) -> str | None:
        """Why the manager stopped by itself (its state file replaced under it), or None."""
        return self.manager.failure if self.manager is not None else None

    def start(self) -> None:
        """Bind, start serving and start the control loop. ``OSError`` when the address is taken."""
        bind = f"{self._host}:{self.config.listen.rpartition(':')[2]}"
        problem = _port_taken(self._host, int(self.config.listen.rpartition(":")[2]))
        if problem is not None:
            # Asked before grpc binds: its failure comes with a log line of its own on stderr.
            self._close_state()
            raise OSError(f"cannot listen on {bind}: {problem}")
        try:
            if self._creds is not None:
                self.port = self._server.add_secure_port(bind, self._creds)
            else:
                self.port = self._server.add_insecure_port(bind)
        except RuntimeError as exc:  # grpc raises RuntimeError when it cannot bind
            self._close_state()
            raise OSError(f"cannot listen on {bind}: {exc}; is another process using the port?") from None
        if not self.port:
            self._close_state()
            raise OSError(f"cannot listen on {bind} (address in use?)")
        advertise = self.config.advertise
        if not advertise:
            host = socket.gethostname() if self._host in ("0.0.0.0", "[::]", "::") else self._host
            advertise = f"{host}:{self.port}"
        state_dir = self.config.state_dir or f"{self.config.db}.d"
        mcfg = ManagerConfig(
            advertise_address=advertise,
            token_file=self.config.token_file,
            tls_ca=self.config.tls_ca or self.config.tls_cert,
            state_dir=state_dir,
            **self.config.manager,
        )
        try:
            self.manager = Manager(self.store, mcfg, pool=self.config.pool, relock=self._lock.ensure)
        except ValueError:  # the pool config stored in the state file no longer validates
            self._server.stop(None)
            self._close_state()
            raise
        pb_grpc.add_VarunaManagerServicer_to_server(_Servicer(self.manager), self._server)
        self._server.start()
        self.manager.start()
        if self._dashboard_at is not None:
            try:
                self._start_dashboard(*self._dashboard_at)
            except OSError:
                self.stop()
                raise

    def _start_dashboard(self, host: str, port: int) -> None:
        """The read-only dashboard in its own thread (``manager.dashboard``), TLS as the RPCs."""
        import ssl

        from manager.dashboard.view import DashboardView
        from manager.dashboard.web import DashboardLimits, DashboardServer

        assert self.manager is not None
        context = None
        if self.config.tls_cert and self.config.tls_key:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        view = DashboardView.from_manager(self.manager)
        timeout = self.config.dashboard_timeout_s
        limits = DashboardLimits(
            header_timeout_s=timeout,
            body_timeout_s=timeout,
            idle_timeout_s=timeout,
            max_connections=dashboard_connections(
                soft_limit=soft_limit(), wanted=self.config.dashboard_max_connections
            ),
        )
        self.dashboard = DashboardServer(
            view, token=self._token, host=host, port=port, ssl_context=context, limits=limits
        )
        self.dashboard.start()

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving (in-flight calls get ``grace_s``), stop the control loop, close the store."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.dashboard is not None:
            self.dashboard.stop()
        self._server.stop(grace_s).wait(grace_s + 3.0)
        if self.manager is not None:
            self.manager.stop()
        self._close_state()

    def _close_state(self) -> None:
        """Close the store, then free the state file for the next manager."""
        self.store.close()
        self._lock.release()


def _dashboard_address(address: str) -> tuple[str, int]:
    """``--dashboard HOST:PORT`` checked, and the extra it needs installed (``ValueError``: one line)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--dashboard {address!r} is not HOST:PORT (port 0: any free port)")
    try:
        require_extra("dashboard", "--dashboard")
    except MissingExtra as exc:
        raise ValueError(str(exc)) from None
    return host.strip("[]"), int(port)


def _lock_state_file(db: str) -> DaemonLock:
    """The state file's daemon lock (``manager.common.daemon_lock``), its directory made first.
    ``OSError`` with one line: another manager holds it, or the path cannot be written."""
    try:
        Path(db).parent.mkdir(parents=True, exist_ok=True)
        return DaemonLock.acquire(db)
    except FileExistsError:
        raise OSError(
            f"cannot create the state file {db}: a parent of it is a file, not a directory"
        ) from None
    except OSError as exc:
        if exc.strerror is None:  # DaemonLockHeld: already one line
            raise
        raise OSError(f"cannot create the state file {db}: {exc.strerror} ({exc.filename or db})") from None


def _check_writable_dir(path: str, option: str) -> None:
    """Create ``path`` and write a file there, or ``OSError`` with one line: pretend VMs keep
    their directories there, and finding out at the first VM would only be a provider error."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".varuna-manager-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OSError(
            f"{option} {path}: cannot write there ({exc.strerror or exc}); pick a writable directory"
        ) from None


def _port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (in use, not an address of this machine), or None.
    SO_REUSEADDR as grpc sets it: a port left in TIME_WAIT is free, a listening one is not."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "the port is in use (another manager?); stop that process or pick another port"
            return f"{exc.strerror}; pick an address of this machine for --listen"
    return None


def insecure_listen_warning(listen_host: str, tls: bool) -> str | None:
    """The warning for serving without TLS on an address other machines can reach, or None.

    >>> insecure_listen_warning("127.0.0.1", tls=False) is None
    True
    >>> insecure_listen_warning("0.0.0.0", tls=False)[:30]
    'listening on 0.0.0.0 without T'
    """
    if tls or is_loopback(listen_host):
        return None
    return (
        f"listening on {listen_host} without TLS: the token and all job data cross the network in"
        " clear text; pass --tls-cert/--tls-key, or listen on 127.0.0.1"
    )
