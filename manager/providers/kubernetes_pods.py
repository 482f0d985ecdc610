"""What the kubernetes provider (manager/providers/kubernetes.py) asks a cluster for: its options,
each VM's pod and Secret (Kubernetes JSON), their names and labels (Note [Kubernetes labels] in
kubernetes.py), and which node taints announce a node's end.

    >>> pod_name("gpt-tiny-3f9a1c-vm3"), label_value("job.x_Y")
    ('gpt-tiny-3f9a1c-vm3', 'job.x_Y')
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from manager.providers.agent_start import AgentStart, agent_argv
from manager.providers.base import ProviderContext
from manager.providers.local import SLOWDOWN_ENV

__all__ = [
    "POD_NOTICE_SOURCE",
    "PREEMPTION_TAINTS",
    "KubernetesProviderOptions",
    "label_value",
    "labels",
    "pod_manifest",
    "pod_name",
    "preemption_reason",
    "secret_manifest",
]

#: The agents' notice source (manager/agent/pod_notices.py): the pod's preStop hook.
POD_NOTICE_SOURCE = "manager.agent.pod_notices:PodTerminationNotices"
#: ``python -m`` module of the preStop hook.
PRE_STOP_MODULE = "manager.agent.pod_notices"

#: Node taints that announce the node's end (the key; any value and effect). Sources:
#: ``ToBeDeletedByClusterAutoscaler`` — the cluster autoscaler before it drains a node it removes
#: (kubernetes/autoscaler, cluster-autoscaler/utils/taints); ``karpenter.sh/disrupted`` — Karpenter
#: v1 before it drains a node it disrupts (``karpenter.sh/disruption`` in v0.32–0.37; karpenter.sh,
#: "Disruption"); ``cloud.google.com/impending-node-termination`` — GKE's node termination /
#: maintenance handler on a Spot or preemptible VM; ``aws-node-termination-handler/spot-itn`` —
#: the AWS Node Termination Handler on a spot interruption notice (the last three are the keys
#: kubernetes-mixin's KubeNodeUnreachable alert treats as planned); ``node.kubernetes.io/unschedulable``
#: — the taint a cordon (``kubectl drain``'s first step) sets, with ``notice_on_cordon``.
PREEMPTION_TAINTS = (
    "ToBeDeletedByClusterAutoscaler",
    "karpenter.sh/disrupted",
    "karpenter.sh/disruption",
    "cloud.google.com/impending-node-termination",
    "aws-node-termination-handler/spot-itn",
)
CORDON_TAINT = "node.kubernetes.io/unschedulable"

MANAGED_BY = ("app.kubernetes.io/managed-by", "varuna-manager")
JOB_LABEL = "varuna.io/job"
VM_LABEL = "varuna.io/vm"
TYPE_LABEL = "varuna.io/vm-type"
VM_ANNOTATION = "varuna.io/vm-id"
JOB_ANNOTATION = "varuna.io/job-id"
#: Where the pod sees its Secret, its notice emptyDir and its log emptyDir.
SECRET_DIR = "/var/run/secrets/varuna"
NOTICE_DIR = "/var/run/varuna/notice"
LOG_DIR = "/var/log/varuna"
#: The preStop hook stops waiting this long before the grace period ends (SIGTERM must still
#: reach the agent before the kubelet's SIGKILL).
PRE_STOP_MARGIN_S = 2
#: Per-type options (``[[vm_types]]`` / a pool type's ``provider_options``).
TYPE_OPTION_KEYS = (
    "image",
    "cpu",
    "memory",
    "gpus",
    "gpu_resource",
    "node_selector",
    "tolerations",
    "priority_class",
    "grace_period_s",
    "labels",
)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _fit(text: str, allowed: str, limit: int, *, lower: bool = False) -> str:
    """``text`` (lower-cased with ``lower``) with every character outside ``allowed`` replaced by
    '-', at most ``limit`` long, alphanumeric at both ends; a hash of ``text`` keeps a name that had
    to change distinct from every other."""
    clean = re.sub(f"[^{allowed}]", "-", text.lower() if lower else text).strip("-_.") or "x"
    if clean == text and len(clean) <= limit:
        return clean
    digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:8]
    return f"{clean[: limit - 9].rstrip('-_.')}-{digest}"


def pod_name(vm_id: str) -> str:
    """The pod (and Secret) of a VM: a DNS label (lower case, at most 63).

    >>> pod_name("gpt-tiny-3f9a1c-vm3")
    'gpt-tiny-3f9a1c-vm3'
    >>> pod_name("GPT_tiny-vm3")  # doctest: +ELLIPSIS
    'gpt-tiny-vm3-...'
    """
    return _fit(vm_id, "a-z0-9-", 63, lower=True)


def label_value(text: str) -> str:
    """``text`` as a label value ([A-Za-z0-9_.-], at most 63, alphanumeric at both ends)."""
    return _fit(text, "A-Za-z0-9_.-", 63)


def preemption_reason(node: Mapping[str, Any], taints: Sequence[str], cordon: bool) -> str:
    """Why a node (a Node object as JSON) is about to go, or "" (module docstring)."""
    spec = node.get("spec") or {}
    for taint in spec.get("taints") or []:
        key = str((taint or {}).get("key", ""))
        if key in taints or (cordon and key == CORDON_TAINT):
            return f"taint {key}"
    if cordon and spec.get("unschedulable"):
        return "cordoned (unschedulable)"
    return ""


@dataclass(frozen=True, kw_only=True)
class KubernetesProviderOptions:
    """``provider_options`` of a kubernetes job (docs/manager.md, "kubernetes")."""

    image: str
    """Container image with ``varuna[manager]`` (and the job's script and data, or a volume)."""
    namespace: str = "default"
    kubeconfig: str | None = None
    """kubeconfig file; None: ``$KUBECONFIG`` or ``~/.kube/config``, or the pod's service account
    when the manager itself runs in the cluster."""
    context: str | None = None
    """kubeconfig context (None: its current one)."""
    in_cluster: bool | None = None
    """True: the service account of the manager's own pod; None: when no kubeconfig is found."""
    python: str = "python3"
    cpu: str | None = None
    """CPU request and limit (``"8"``, ``"7500m"``)."""
    memory: str | None = None
    """Memory request and limit (``"60Gi"``)."""
    gpus: int = 0
    """Accelerators per VM (``gpu_resource`` request and limit)."""
    gpu_resource: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = field(default_factory=dict)
    """e.g. ``{"cloud.google.com/gke-spot": "true"}`` or ``{"karpenter.sh/capacity-type": "spot"}``."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """e.g. ``[{"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value":
    "spot", "effect": "NoSchedule"}]`` for an AKS spot pool."""
    priority_class: str = ""
    grace_period_s: int = 30
    """``terminationGracePeriodSeconds``: the notice's length (GKE Spot gives pods 15–30 s)."""
    delete_grace_s: int = 5
    """Grace of the manager's own deletes (the VM is lost or the job is over)."""
    preemption_taints: list[str] = field(default_factory=lambda: list(PREEMPTION_TAINTS))
    notice_on_cordon: bool = True
    """A cordoned node (``kubectl drain``, termination handlers) is a notice too."""
    service_account: str = ""
    """The pods' service account (they need no API access: no token is mounted)."""
    host_network: bool = False
    """The pods use the node's network (NCCL over the node's interfaces)."""
    image_pull_policy: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra pod labels (e.g. a Kueue queue)."""
    volumes: list[dict[str, Any]] = field(default_factory=list)
    """Extra pod volumes (Kubernetes JSON): the shared storage the job's script, working directory
    and checkpoint directory live on, at the same paths as in the job spec."""
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    standby: bool = True
    """Agents keep pre-imported standby workers (Note [Standby] in manager/agent/vm_agent.py)."""
    api_timeout_s: float = 10.0
    """Timeout of one API call; a watch is re-opened after this long without news."""
    sweep_interval_s: float = 30.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KubernetesProviderOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"provider_options: unknown kubernetes option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        if not data.get("image") or not isinstance(data.get("image"), str):
            raise ValueError(
                "provider_options: kubernetes needs image (a container image with varuna[manager] installed)"
            )
        opts = cls(**dict(data))
        opts._check()
        return opts

    def _check(self) -> None:  # noqa: C901, PLR0912 — one line per option, nothing to factor
        where = "provider_options"
        if not isinstance(self.namespace, str) or not _DNS_LABEL.match(self.namespace):
            raise ValueError(f"{where}.namespace {self.namespace!r} is not a namespace name (a DNS label)")
        if self.in_cluster is not None and not isinstance(self.in_cluster, bool):
            raise ValueError(f"{where}.in_cluster must be true, false or unset")
        for name in ("kubeconfig", "context", "cpu", "memory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{where}.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 0:
            raise ValueError(f"{where}.gpus must be an integer >= 0, got {self.gpus!r}")
        for name in ("grace_period_s", "delete_grace_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{where}.{name} must be an integer number of seconds >= 0, got {value!r}")
        if self.grace_period_s <= PRE_STOP_MARGIN_S:
            raise ValueError(
                f"{where}.grace_period_s must exceed {PRE_STOP_MARGIN_S} s (the agent stops its "
                f"workers within it), got {self.grace_period_s}"
            )
        for name in ("node_selector", "labels"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                raise ValueError(f"{where}.{name} must be a table of strings, got {value!r}")
        for name in ("tolerations", "volumes", "volume_mounts"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
                raise ValueError(f"{where}.{name} must be a list of tables (Kubernetes JSON), got {value!r}")
        if not isinstance(self.preemption_taints, list) or not all(
            isinstance(x, str) for x in self.preemption_taints
        ):
            raise ValueError(f"{where}.preemption_taints must be a list of taint keys")
        for name in ("api_timeout_s", "sweep_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{where}.{name} must be a number > 0, got {value!r}")

    def typed(self, type_options: Mapping[str, Any] | None) -> KubernetesProviderOptions:
        """These options for VMs of a type (its ``provider_options`` replace the job's)."""
        overrides = {k: v for k, v in (type_options or {}).items() if k in TYPE_OPTION_KEYS}
        if not overrides:
            return self
        opts = replace(self, **overrides)
        opts._check()
        return opts


# -- manifests ---------------------------------------------------------------------------------


def labels(job_id: str, vm_id: str, vm_type: str = "") -> dict[str, str]:
    """The labels of a VM's pod and Secret (Note [Kubernetes labels] in kubernetes.py)."""
    out = {MANAGED_BY[0]: MANAGED_BY[1], JOB_LABEL: label_value(job_id), VM_LABEL: label_value(vm_id)}
    if vm_type:
        out[TYPE_LABEL] = label_value(vm_type)
    return out


def agent_start(
    options: KubernetesProviderOptions,
    context: ProviderContext,
    job_id: str,
    vm_id: str,
    slots: int,
    notice_source: str | None,
) -> AgentStart:
    """What the pod's agent is started with (paths inside the pod)."""
    c = context
    return AgentStart(
        python=options.python,
        manager=c.manager_address,
        token_file=f"{SECRET_DIR}/token",
        vm_id=vm_id,
        job_id=job_id,
        slots=slots,
        log_dir=LOG_DIR,
        heartbeat_interval_s=c.heartbeat_interval_s,
        orphan_timeout_s=c.orphan_timeout_s,
        fence_timeout_s=c.fence_timeout_s,  # Note [Fencing under the manager]
        silence_probe_after_s=c.silence_probe_after_s,
        tls_ca=f"{SECRET_DIR}/ca.pem" if c.tls_ca else None,
        notice_source=notice_source,
        notice_url=NOTICE_DIR,
        vm_name=pod_name(vm_id),
        approve_notices=True,  # the preStop hook waits for it (Note [Pod termination notice])
        standby=slots if options.standby else 0,
    )


def _container(
    options: KubernetesProviderOptions, argv: list[str], name: str, type_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The pod's one container: the agent, its mounts and its preStop hook."""
    resources: dict[str, str] = {}
    if options.cpu:
        resources["cpu"] = options.cpu
    if options.memory:
        resources["memory"] = options.memory
    if options.gpus:
        resources[options.gpu_resource] = str(options.gpus)
    env = []
    slowdown = float((type_options or {}).get("vm_slowdown", 1.0))
    if slowdown > 1.0:  # a slower pool type emulated (docs/pool.md), as on pretend VMs
        env.append({"name": SLOWDOWN_ENV, "value": f"{slowdown:g}"})
    hook = [
        options.python,
        "-m",
        PRE_STOP_MODULE,
        "pre-stop",
        "--dir",
        NOTICE_DIR,
        "--wait",
        str(options.grace_period_s - PRE_STOP_MARGIN_S),
        "--pod",
        name,
    ]
    container: dict[str, Any] = {
        "name": "agent",
        "image": options.image,
        "command": argv,
        "env": env,
        "resources": {"requests": resources, "limits": resources} if resources else {},
        "volumeMounts": [
            {"name": "varuna-secret", "mountPath": SECRET_DIR, "readOnly": True},
            {"name": "varuna-notice", "mountPath": NOTICE_DIR},
            {"name": "varuna-logs", "mountPath": LOG_DIR},
            *options.volume_mounts,
        ],
        "lifecycle": {"preStop": {"exec": {"command": hook}}},
    }
    if options.image_pull_policy:
        container["imagePullPolicy"] = options.image_pull_policy
    return container


def pod_manifest(
    options: KubernetesProviderOptions,
    context: ProviderContext,
    job_id: str,
    vm_id: str,
    slots: int,
    *,
    notice_source: str | None,
    type_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The pod of one VM (module docstring of kubernetes.py)."""
    name = pod_name(vm_id)
    vm_type = str((type_options or {}).get("vm_type", "") or "")
    argv = agent_argv(agent_start(options, context, job_id, vm_id, slots, notice_source))
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": options.grace_period_s,
        "automountServiceAccountToken": False,
        "containers": [_container(options, argv, name, type_options)],
        "volumes": [
            {"name": "varuna-secret", "secret": {"secretName": name, "defaultMode": 0o400}},
            {"name": "varuna-notice", "emptyDir": {}},
            {"name": "varuna-logs", "emptyDir": {}},
            *options.volumes,
        ],
    }
    if options.node_selector:
        spec["nodeSelector"] = dict(options.node_selector)
    if options.tolerations:
        spec["tolerations"] = list(options.tolerations)
    if options.priority_class:
        spec["priorityClassName"] = options.priority_class
    if options.service_account:
        spec["serviceAccountName"] = options.service_account
    if options.host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": options.namespace,
            "labels": {**options.labels, **labels(job_id, vm_id, vm_type)},
            "annotations": {VM_ANNOTATION: vm_id, JOB_ANNOTATION: job_id},
        },
        "spec": spec,
    }


def secret_manifest(
    namespace: str, job_id: str, vm_id: str, pod: Mapping[str, Any], data: Mapping[str, str]
) -> dict[str, Any]:
    """The pod's Secret holding ``data`` (the token, the CA), owned by the pod when it has a uid."""
    meta = pod.get("metadata") or {}
    out: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": meta.get("name", pod_name(vm_id)),
            "namespace": namespace,
            "labels": labels(job_id, vm_id),
        },
        "data": {k: base64.b64encode(v.encode("utf-8")).decode("ascii") for k, v in data.items()},
    }
    if meta.get("uid"):
        out["metadata"]["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
        ]
    return out
