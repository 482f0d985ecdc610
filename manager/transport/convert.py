"""The wire and the domain: protobuf messages (manager/transport/varuna_manager.proto) to the
plain dataclasses of :mod:`manager.domain.messages` and back. The field names are the same on
both sides, so each conversion is a copy; only here do the two meet.

    >>> from manager.domain.messages import Action, Orders, WorkerLaunch
    >>> msg = orders_to_pb(Orders(action=Action.RUN, generation=2,
    ...                           workers=[WorkerLaunch(rank=1, argv=("a",), env={"K": "v"})]))
    >>> pb.Orders.Action.Name(msg.action), msg.workers[0].env["K"]
    ('RUN', 'v')
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from manager.domain.errors import ErrorKind, ManagerError
from manager.domain.jobspec import JobSpec
from manager.domain.messages import (
    CalibrationReply,
    CalibrationReport,
    JobStatus,
    Orders,
    PreemptNotice,
    Registered,
    RegisterVM,
    VMHeartbeat,
    WorkerHeartbeat,
    WorkerState,
)
from manager.domain.records import EventRecord
from manager.transport import varuna_manager_pb2 as pb

__all__ = [
    "event_to_pb",
    "heartbeat_from_pb",
    "orders_to_pb",
    "register_from_pb",
    "registered_to_pb",
    "report_from_pb",
    "report_reply_to_pb",
    "spec_from_pb",
    "spec_to_pb",
    "status_to_pb",
    "submission_from_pb",
    "worker_heartbeat_from_pb",
]


def _copy(msg: Any, cls: type, **overrides: Any) -> Any:
    """``cls`` (a domain dataclass) with every field read from the message of the same name."""
    values = {f.name: getattr(msg, f.name) for f in fields(cls) if f.name not in overrides}
    return cls(**values, **overrides)


# -- agents ------------------------------------------------------------------------------------


def register_from_pb(msg: pb.RegisterVMRequest) -> RegisterVM:
    return _copy(msg, RegisterVM)


def registered_to_pb(reply: Registered) -> pb.RegisterVMReply:
    return pb.RegisterVMReply(heartbeat_interval_s=reply.heartbeat_interval_s, message=reply.message)


def heartbeat_from_pb(msg: pb.VMHeartbeatRequest) -> VMHeartbeat:
    """An agent's heartbeat; its notice only when ``has_notice`` says there is one."""
    return _copy(
        msg,
        VMHeartbeat,
        workers=tuple(_copy(w, WorkerState) for w in msg.workers),
        notice=_copy(msg.notice, PreemptNotice) if msg.has_notice else None,
    )


def orders_to_pb(orders: Orders) -> pb.Orders:
    out = pb.Orders(
        action=pb.Orders.Action.Value(orders.action.name),
        generation=orders.generation,
        stop_timeout_s=orders.stop_timeout_s,
        heartbeat_interval_s=orders.heartbeat_interval_s,
        training=orders.training,
        leave=orders.leave,
        kill=orders.kill,
    )
    for w in orders.workers:
        out.workers.add(rank=w.rank, argv=list(w.argv), env=dict(w.env), cwd=w.cwd)
    if orders.profile is not None:
        p = orders.profile
        out.profile.CopyFrom(pb.ProfileOrder(
            attempt=p.attempt, argv=list(p.argv), env=dict(p.env), cwd=p.cwd, timeout_s=p.timeout_s
        ))
    return out


def report_from_pb(msg: pb.ReportCalibrationRequest) -> CalibrationReport:
    return _copy(msg, CalibrationReport)


def report_reply_to_pb(reply: CalibrationReply) -> pb.ReportCalibrationReply:
    return pb.ReportCalibrationReply(accepted=reply.accepted, message=reply.message)


# -- workers -----------------------------------------------------------------------------------


def worker_heartbeat_from_pb(msg: pb.WorkerHeartbeatRequest) -> WorkerHeartbeat:
    return _copy(msg, WorkerHeartbeat)


# -- the CLI -----------------------------------------------------------------------------------


def submission_from_pb(msg: pb.JobSpec) -> tuple[JobSpec, str]:
    """A submitted job spec and its calibration file's content; a spec that does not validate is
    refused here (``ManagerError`` INVALID_ARGUMENT, one line)."""
    try:
        return spec_from_pb(msg), msg.calibration_json
    except (ValueError, TypeError) as exc:
        raise ManagerError(ErrorKind.INVALID_ARGUMENT, str(exc).splitlines()[0]) from None


def status_to_pb(status: JobStatus) -> pb.JobStatus:
    plain = {f.name: getattr(status, f.name) for f in fields(status)
             if f.name not in ("vms", "throughput", "pool")}
    out = pb.JobStatus(**plain)
    for vm in status.vms:
        v = out.vms.add(**{f.name: getattr(vm, f.name) for f in fields(vm) if f.name != "workers"})
        for w in vm.workers:
            v.workers.add(**{f.name: getattr(w, f.name) for f in fields(w)})
    for point in status.throughput:
        out.throughput.add(**{f.name: getattr(point, f.name) for f in fields(point)})
    if status.pool is not None:
        out.pool.CopyFrom(pb.PoolShare(**{f.name: getattr(status.pool, f.name) for f in fields(status.pool)}))
    return out


def event_to_pb(e: EventRecord) -> pb.Event:
    return pb.Event(id=e.id, job_id=e.job_id, time=e.time, kind=e.kind, vm_id=e.vm_id,
                    generation=e.generation, message=e.message, data_json=e.data_json)


# -- the job spec ------------------------------------------------------------------------------


def spec_to_pb(spec: JobSpec, calibration_json: str = "") -> pb.JobSpec:
    """The wire form of ``spec`` (a ``varuna_manager_pb2.JobSpec``); ``calibration_json`` is the
    calibration file's content, sent along because the manager may not see the submitter's files."""
    from manager.transport import varuna_manager_pb2 as pb
    return pb.JobSpec(
        name=spec.name,
        script=spec.script,
        args=list(spec.args),
        module=spec.module,
        workdir=spec.workdir,
        global_batch_size=spec.global_batch_size,
        micro_batch_size=spec.micro_batch_size,
        checkpoint_dir=spec.checkpoint_dir,
        checkpoint_every=spec.checkpoint_every,
        provider=spec.provider,
        provider_options_json=json.dumps(spec.provider_options, sort_keys=True),
        min_vms=spec.min_vms,
        max_vms=spec.max_vms,
        procs_per_vm=spec.procs_per_vm,
        target_steps=spec.target_steps,
        calibration_json=calibration_json,
        pipeline_depth=spec.pipeline_depth,
        num_segments=spec.num_segments,
        env=dict(spec.env),
        gpu_memory_bytes=int(spec.gpu_memory_gib * 2**30),
        profile_json=json.dumps(spec.profile, sort_keys=True) if spec.profile else "",
        schedule=spec.schedule,
        pool=spec.pool,
        weight=spec.weight,
        vm_types_json=json.dumps(spec.vm_types, sort_keys=True) if spec.vm_types else "",
        live_morph=spec.live_morph,
        chunks=spec.chunks,
    )


def spec_from_pb(msg: pb.JobSpec) -> JobSpec:
    """Inverse of :func:`spec_to_pb` (without the calibration); ``ValueError`` when invalid."""
    try:
        options = json.loads(msg.provider_options_json) if msg.provider_options_json else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"jobspec: provider_options is not valid JSON: {exc.msg}") from None
    try:
        profile = json.loads(msg.profile_json) if msg.profile_json else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"jobspec: profile is not valid JSON: {exc.msg}") from None
    try:
        vm_types = json.loads(msg.vm_types_json) if msg.vm_types_json else []
    except json.JSONDecodeError as exc:
        raise ValueError(f"jobspec: vm_types is not valid JSON: {exc.msg}") from None
    return JobSpec(
        name=msg.name,
        script=msg.script,
        args=list(msg.args),
        module=msg.module,
        workdir=msg.workdir,
        global_batch_size=int(msg.global_batch_size),
        micro_batch_size=int(msg.micro_batch_size),
        checkpoint_dir=msg.checkpoint_dir,
        checkpoint_every=int(msg.checkpoint_every),
        provider=msg.provider,
        provider_options=options,
        min_vms=int(msg.min_vms),
        max_vms=int(msg.max_vms),
        procs_per_vm=int(msg.procs_per_vm),
        target_steps=int(msg.target_steps),
        pipeline_depth=int(msg.pipeline_depth),
        num_segments=int(msg.num_segments),
        env=dict(msg.env),
        gpu_memory_gib=msg.gpu_memory_bytes / 2**30,
        profile=profile,
        schedule=msg.schedule,
        pool=msg.pool,
        weight=msg.weight or 1.0,
        vm_types=vm_types,
        live_morph=msg.live_morph,
        chunks=int(msg.chunks),
    )
