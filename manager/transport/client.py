"""Client side of the manager's gRPC interface: the CLI, per-VM agents and training workers
(:mod:`manager.worker.reporter`) use it.

:class:`ManagerClient` wraps every RPC with the bearer token and a timeout; :class:`ClientConfig`
says where the manager is (``ClientConfig.from_env``: ``VARUNA_MANAGER``,
``VARUNA_MANAGER_TOKEN_FILE``, ``VARUNA_MANAGER_TLS_CA``, as the agents set them for workers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from manager.common.wire import load_token
from manager.transport import varuna_manager_pb2 as pb
from manager.transport import varuna_manager_pb2_grpc as pb_grpc
from manager.transport.auth import bearer_metadata, client_channel

__all__ = ["ClientConfig", "ManagerClient"]

#: Default deadline of one RPC: heartbeats are tiny, a manager that needs longer is in trouble.
RPC_TIMEOUT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Where the manager is and how to authenticate."""

    address: str
    """``host:port`` of ``varuna-manager serve``."""
    token: str
    """The shared bearer token (read from a file with :func:`manager.common.wire.load_token`)."""
    tls_ca: str | None = None
    """PEM file to verify the manager's certificate; None: plain TCP (unless ``tls``)."""
    tls: bool = False
    """Use TLS with the system's root certificates."""
    timeout_s: float = RPC_TIMEOUT_S

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ClientConfig | None:
        """From ``VARUNA_MANAGER`` / ``VARUNA_MANAGER_TOKEN_FILE`` / ``VARUNA_MANAGER_TLS_CA``;
        None when ``VARUNA_MANAGER`` is unset. ``ValueError`` if the token cannot be read."""
        env = os.environ if environ is None else environ
        address = env.get("VARUNA_MANAGER")
        if not address:
            return None
        token_file = env.get("VARUNA_MANAGER_TOKEN_FILE")
        if not token_file:
            raise ValueError("VARUNA_MANAGER is set but VARUNA_MANAGER_TOKEN_FILE is not")
        return cls(
            address=address, token=load_token(token_file), tls_ca=env.get("VARUNA_MANAGER_TLS_CA") or None
        )


class ManagerClient:
    """One channel to the manager; every method is one RPC and raises ``grpc.RpcError`` on
    failure (``UNAUTHENTICATED`` for a bad token, ``UNAVAILABLE`` when the manager is down).

    Example::

        with ManagerClient(ClientConfig(address="127.0.0.1:7000", token=tok)) as c:
            job_id = c.submit(spec)
    """

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._channel = client_channel(config.address, tls_ca=config.tls_ca, tls=config.tls)
        self._stub = pb_grpc.VarunaManagerStub(self._channel)
        self._metadata = bearer_metadata(config.token)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self, method: str, request: Any, timeout_s: float | None, *, wait_for_ready: bool = False
    ) -> Any:
        fn = getattr(self._stub, method)
        return fn(
            request,
            timeout=timeout_s or self.config.timeout_s,
            metadata=self._metadata,
            wait_for_ready=wait_for_ready,
        )

    # -- CLI -----------------------------------------------------------------------------------

    def submit(self, spec: pb.JobSpec, *, timeout_s: float | None = None) -> str:
        return self._call("SubmitJob", pb.SubmitJobRequest(spec=spec), timeout_s).job_id

    def status(
        self, job_id: str = "", *, history: int = 20, timeout_s: float | None = None
    ) -> list[pb.JobStatus]:
        return list(
            self._call("GetStatus", pb.GetStatusRequest(job_id=job_id, history=history), timeout_s).jobs
        )

    def events(
        self, job_id: str = "", *, after_id: int = 0, limit: int = 0, timeout_s: float | None = None
    ) -> list[pb.Event]:
        req = pb.ListEventsRequest(job_id=job_id, after_id=after_id, limit=limit)
        return list(self._call("ListEvents", req, timeout_s).events)

    def cancel(self, job_id: str, *, timeout_s: float | None = None) -> str:
        return self._call("CancelJob", pb.CancelJobRequest(job_id=job_id), timeout_s).state

    # -- agents --------------------------------------------------------------------------------

    def register_vm(
        self, request: pb.RegisterVMRequest, *, timeout_s: float | None = None
    ) -> pb.RegisterVMReply:
        return self._call("RegisterVM", request, timeout_s)

    # Heartbeats wait (up to their deadline) for the connection instead of failing at once while
    # the channel is between reconnect attempts: a restarted manager then hears from everyone
    # as soon as it listens. CLI calls fail fast instead (a person is waiting).

    def vm_heartbeat(self, request: pb.VMHeartbeatRequest, *, timeout_s: float | None = None) -> pb.Orders:
        return self._call("VMHeartbeat", request, timeout_s, wait_for_ready=True).orders

    def report_calibration(
        self, request: pb.ReportCalibrationRequest, *, timeout_s: float | None = None
    ) -> pb.ReportCalibrationReply:
        """Hand the result of a PROFILE order back (the calibration file travels in the request)."""
        return self._call("ReportCalibration", request, timeout_s, wait_for_ready=True)

    # -- workers -------------------------------------------------------------------------------

    def worker_heartbeat(self, request: pb.WorkerHeartbeatRequest, *, timeout_s: float | None = None) -> bool:
        return self._call("WorkerHeartbeat", request, timeout_s, wait_for_ready=True).ok
