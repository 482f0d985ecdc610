"""Kubernetes: one pod per VM, on whatever node pools the cluster has (GKE Spot, EKS with
Karpenter, AKS spot pools, CoreWeave...), through the official ``kubernetes`` client.

- ``create_vms``: one pod per VM, ``restartPolicy: Never``, whose container's command is the
  manager's agent (:func:`manager.providers.agent_start.agent_argv`), with the VM type's image,
  resources, node selector and tolerations (a spot pool and an on-demand pool are two VM types);
  then one Secret per pod holding the manager's token (and TLS CA), mounted read-only into the
  pod and owned by it (``ownerReferences``: the cluster's garbage collector deletes it with the
  pod). The token is never on the command line nor in the pod spec.
- ``gone_vms``: a watch on the job's pods (list, then watch from the list's resourceVersion, re-
  listed whenever a watch ends or fails) says which pods were deleted or ended (``Succeeded`` /
  ``Failed``: a GKE Spot VM's graceful node shutdown leaves its pods ``Failed``). A pod that is
  terminating is not gone yet: it is in its grace period, during which its agent got the notice.
- A second watch on the nodes: a node hosting one of the job's pods that gets a preemption taint
  (:data:`PREEMPTION_TAINTS`) or is cordoned has those pods deleted gracefully at once, so their
  agents get the notice (Note [Pod termination notice] in manager/agent/pod_notices.py) with the
  whole grace period left, before the drain that would follow.
- ``delete_vm``: delete the pod (grace ``delete_grace_s``) and its Secret; 404 is fine.

Note [Kubernetes labels]: every pod and Secret carries ``app.kubernetes.io/managed-by:
varuna-manager`` and ``varuna.io/job`` (the job id as a label value), so a restarted manager
lists its own (the store keeps each VM's pod name in its provider reference) and deletes what a
manager killed mid-request left behind: a labelled pod or Secret of the job whose VM is not among
the job's live VMs, and that this process did not just create, is deleted (at most every
``sweep_interval_s``). Pods outlive the manager on purpose, as the local provider's agents do: a
restarted manager finds them again, and an agent alone exits after its orphan timeout.

Testing: no real cluster was reached from this repository. tests/test_manager_kubernetes.py and
the slow tests/test_manager_kubernetes_e2e.py run this module with the real client against a real
HTTP server on loopback (kmock's Kubernetes emulator), with a small kubelet in the test that runs
each pod's command as a local process group (docs/manager.md, "kubernetes").
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manager.providers.base import NewVM, ProviderContext, ProviderVM
from manager.providers.kubernetes_pods import (
    JOB_LABEL,
    MANAGED_BY,
    POD_NOTICE_SOURCE,
    PREEMPTION_TAINTS,
    TYPE_OPTION_KEYS,
    KubernetesProviderOptions,
    label_value,
    pod_manifest,
    pod_name,
    preemption_reason,
    secret_manifest,
)
from manager.providers.registry import ProviderExtra, provider_entry, register_provider

__all__ = [
    "KUBERNETES_EXTRA",
    "POD_NOTICE_SOURCE",
    "PREEMPTION_TAINTS",
    "KubernetesProvider",
    "KubernetesProviderOptions",
    "label_value",
    "pod_name",
    "preemption_reason",
]

#: What needs the kubernetes extra, as its one-line error names it.
KUBERNETES_WHAT = "the kubernetes provider (on the manager's host)"
KUBERNETES_EXTRA = ProviderExtra(
    name="kubernetes", packages={"kubernetes": "kubernetes"}, what=KUBERNETES_WHAT
)


def api_client(options: KubernetesProviderOptions) -> Any:
    """An ``ApiClient`` for the options' cluster (kubeconfig, or the in-cluster service account);
    ``RuntimeError`` (one line) when neither is usable. Nothing global is configured."""
    from kubernetes import client, config

    in_cluster = options.in_cluster
    if in_cluster is None:
        kubeconfig = options.kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        kubeconfig = kubeconfig or os.path.expanduser(config.KUBE_CONFIG_DEFAULT_LOCATION)
        in_cluster = not os.path.exists(kubeconfig) and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    try:
        if in_cluster:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
        return config.new_client_from_config(
            config_file=options.kubeconfig, context=options.context, persist_config=False
        )
    except (config.ConfigException, OSError, ValueError, TypeError) as exc:
        where = (
            "the in-cluster service account"
            if in_cluster
            else (f"kubeconfig {options.kubeconfig or '$KUBECONFIG or ~/.kube/config'}")
        )
        raise RuntimeError(f"kubernetes: cannot use {where}: {exc}".splitlines()[0]) from None


def api_error(exc: BaseException, what: str) -> str:
    """One line for a failed API call: the API's own message when it sent one, else why the API
    server could not be reached."""
    import json

    status = getattr(exc, "status", None)
    if status is not None:
        message = str(getattr(exc, "reason", "") or "")
        try:
            body = json.loads(getattr(exc, "body", "") or "{}")
            message = str(body.get("message") or message)
        except (ValueError, AttributeError):
            pass
        return f"kubernetes: {what}: {status} {message}".splitlines()[0]
    reason = getattr(exc, "reason", None) or exc  # urllib3's MaxRetryError wraps the cause
    return f"kubernetes: {what}: cannot reach the API server: {reason}".splitlines()[0]


@dataclass
class _PodCache:
    """What the watches know (under the provider's lock)."""

    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    listed_at: float | None = None
    """``time.monotonic()`` when the last complete pod list started (None: never listed yet)."""
    noticed: set[str] = field(default_factory=set)
    """Pods this provider deleted because their node is going (once each)."""


def _cut(resp: Any) -> None:
    """Note [Prompt close]: a watch thread sits in a socket read until the server sends an event
    or api_timeout_s passes; shutting the response's socket down wakes it now, so a manager
    stopping does not wait up to api_timeout_s per watch (``shutdown``: urllib3 >= 2.3)."""
    shutdown = getattr(resp, "shutdown", None)
    if shutdown is not None:
        with contextlib.suppress(OSError):
            shutdown()


@register_provider(
    name="kubernetes",
    options=KubernetesProviderOptions,
    extra=KUBERNETES_EXTRA,
    type_options=TYPE_OPTION_KEYS,
    notice_source=POD_NOTICE_SOURCE,
)
class KubernetesProvider:
    """See the module docstring. ``client`` (a ``kubernetes.client.ApiClient``) is for tests and
    special set-ups; by default :func:`api_client` makes one from the options."""

    name = "kubernetes"

    def __init__(
        self,
        options: KubernetesProviderOptions,
        context: ProviderContext,
        *,
        client: Any = None,
        token: str | None = None,
        say: Any = None,
    ) -> None:
        if client is None:
            KUBERNETES_EXTRA.require()
        self.options = options
        self.context = context
        self._client = client
        self._token = token
        self._say_fn = say
        self._lock = threading.Lock()
        self._cache = _PodCache()
        self._created: dict[str, float] = {}  # pod -> when this process created it
        self._job_id = ""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The watches' open responses, so close() can cut a read that would block up to
        # api_timeout_s (Note [Prompt close]).
        self._streams: dict[str, Any] = {}
        self._last_sweep = time.monotonic()
        self._said: set[str] = set()

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = api_client(self.options)
        return self._client

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.client)

    def _say(self, text: str) -> None:
        if self._say_fn is not None:
            self._say_fn(text)
        else:
            stamp = time.strftime("%H:%M:%S")
            print(f"{stamp} varuna-manager: {text}", file=sys.stderr, flush=True)

    def _say_once(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            self._say(text)

    def _read_token(self) -> str:
        if self._token is None:
            from manager.common.wire import load_token

            self._token = load_token(self.context.token_file)
        return self._token

    def _selector(self, job_id: str) -> str:
        return f"{MANAGED_BY[0]}={MANAGED_BY[1]},{JOB_LABEL}={label_value(job_id)}"

    # -- manifests -----------------------------------------------------------------------------

    def pod_manifest(
        self,
        job_id: str,
        vm_id: str,
        slots: int,
        options: KubernetesProviderOptions,
        type_options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The pod of one VM (:func:`manager.providers.kubernetes_pods.pod_manifest`)."""
        return pod_manifest(
            options,
            self.context,
            job_id,
            vm_id,
            slots,
            notice_source=provider_entry(self.name).notice_source,
            type_options=type_options,
        )

    def secret_manifest(self, job_id: str, vm_id: str, pod: Mapping[str, Any]) -> dict[str, Any]:
        """The pod's Secret: the manager's token (and the CA with TLS)."""
        data = {"token": self._read_token()}
        if self.context.tls_ca:
            data["ca.pem"] = Path(self.context.tls_ca).read_text(encoding="utf-8")
        return secret_manifest(self.options.namespace, job_id, vm_id, pod, data)

    # -- Provider interface --------------------------------------------------------------------

    def create_vms(
        self,
        job_id: str,
        names: Sequence[str],
        slots: int,
        *,
        created_so_far: int,
        type_options: Mapping[str, Any] | None = None,
    ) -> list[NewVM]:
        from kubernetes.client import ApiException
        from urllib3.exceptions import HTTPError

        options = self.options.typed(type_options)
        try:
            self._read_token()
        except (OSError, ValueError) as exc:
            raise RuntimeError(
                f"kubernetes: cannot read the manager's token: {exc}".splitlines()[0]
            ) from None
        _ = self.client  # RuntimeError (one line) when the cluster's configuration is unusable
        self._start_watches(job_id)
        out: list[NewVM] = []
        for vm_id in names:
            manifest = self.pod_manifest(job_id, vm_id, slots, options, type_options)
            name = manifest["metadata"]["name"]
            try:
                pod = self.client.sanitize_for_serialization(
                    self.core.create_namespaced_pod(
                        options.namespace, manifest, _request_timeout=options.api_timeout_s
                    )
                )
                with self._lock:
                    self._created[name] = time.monotonic()
                secret = self.secret_manifest(job_id, vm_id, pod)
                self.core.create_namespaced_secret(
                    options.namespace, secret, _request_timeout=options.api_timeout_s
                )
            except (ApiException, HTTPError, OSError) as exc:
                # Half made (the Secret failed), or a pod of that name left by a manager that died
                # mid-request (409): delete it; the manager asks again after its back-off.
                self._delete(name, 0)
                message = api_error(exc, f"cannot create pod {options.namespace}/{name}")
                if out and getattr(exc, "status", None) in (403, 409, 422):  # quota: fewer VMs now
                    self._say(message)
                    return out
                raise RuntimeError(message) from None
            out.append(NewVM(vm_id=vm_id, ref={"pod": name, "namespace": options.namespace}))
        return out

    def delete_vm(self, vm: ProviderVM) -> None:
        name = str(vm.ref.get("pod") or pod_name(vm.vm_id))
        self._delete(name, self.options.delete_grace_s, strict=True)

    def _delete(self, name: str, grace_s: int | None, *, strict: bool = False, secret: bool = True) -> None:
        """Delete pod ``name`` (``grace_s`` None: the pod's own grace period) and its Secret; a
        failure other than 404 is a ``RuntimeError`` (one line) when ``strict``, else ignored."""
        from kubernetes.client import ApiException
        from urllib3.exceptions import HTTPError

        ns = self.options.namespace
        calls = [("pod", self.core.delete_namespaced_pod)]
        if secret:
            calls.append(("secret", self.core.delete_namespaced_secret))
        for kind, call in calls:
            kw = {"grace_period_seconds": grace_s} if kind == "pod" and grace_s is not None else {}
            try:
                call(name, ns, _request_timeout=self.options.api_timeout_s, **kw)
            except (ApiException, HTTPError, OSError) as exc:
                if strict and getattr(exc, "status", None) != 404:
                    raise RuntimeError(api_error(exc, f"cannot delete {kind} {ns}/{name}")) from None

    def gone_vms(self, vms: Sequence[ProviderVM]) -> list[str]:
        if not vms:
            return []
        try:
            _ = self.client
        except RuntimeError as exc:  # once: gone_vms is asked every tick
            self._say_once(str(exc))
            return []
        self._start_watches(vms[0].job_id)
        with self._lock:
            cache = self._cache
            if cache.listed_at is None:
                return []  # not listed yet: nothing is known to be gone
            gone = [vm.vm_id for vm in vms if self._pod_gone(str(vm.ref.get("pod") or pod_name(vm.vm_id)))]
        self._sweep(vms)
        return gone

    def _pod_gone(self, name: str) -> bool:
        """Under the lock: whether the watches know the pod is deleted or has ended."""
        cache = self._cache
        if name in cache.deleted:
            return True
        pod = cache.pods.get(name)
        if pod is None:
            # Not in the newest list: gone, unless this process created it after that list began.
            created = self._created.get(name)
            return created is None or (cache.listed_at is not None and created < cache.listed_at)
        phase = (pod.get("status") or {}).get("phase")
        return phase in ("Succeeded", "Failed")

    def _sweep(self, vms: Sequence[ProviderVM]) -> None:
        """Delete the job's labelled pods that no live VM of the job names (Note [Kubernetes labels])."""
        now = time.monotonic()
        if now - self._last_sweep < self.options.sweep_interval_s:
            return
        self._last_sweep = now
        wanted = {str(vm.ref.get("pod") or pod_name(vm.vm_id)) for vm in vms}
        with self._lock:
            recent = {n for n, t in self._created.items() if now - t < 2 * self.options.sweep_interval_s}
            strays = [
                n
                for n in self._cache.pods
                if n not in wanted
                and n not in recent
                and not (self._cache.pods[n].get("metadata") or {}).get("deletionTimestamp")
            ]
        for name in strays:
            self._say(
                f"kubernetes: deleting pod {self.options.namespace}/{name}: no live VM of job "
                f"{self._job_id} names it"
            )
            self._delete(name, self.options.delete_grace_s)

    def close(self) -> None:
        """Stop the watches (the pods stay: Note [Kubernetes labels])."""
        self._stop.set()
        with self._lock:
            streams = list(self._streams.values())
        for resp in streams:
            _cut(resp)
        for t in self._threads:
            t.join(timeout=2 * self.options.api_timeout_s)
        self._threads = []
        if self._client is not None and hasattr(self._client, "close"):
            self._client.close()

    # -- watches -------------------------------------------------------------------------------

    def _start_watches(self, job_id: str) -> None:
        """Start the pod and node watches of the job (once; one provider serves one job)."""
        with self._lock:
            if self._threads or self._stop.is_set():
                return
            self._job_id = job_id
            self._threads = [
                threading.Thread(target=self._watch_loop, args=("pods",), name="k8s-pods", daemon=True),
                threading.Thread(target=self._watch_loop, args=("nodes",), name="k8s-nodes", daemon=True),
            ]
            threads = list(self._threads)
        for t in threads:
            t.start()

    def _watch_loop(self, kind: str) -> None:
        """List, then watch from the list's resourceVersion (informer-like). A quiet watch ends
        after ``api_timeout_s``: pods are listed again (a deletion is never missed, whatever the
        server replays), nodes are watched on from the last version seen; an error lists again
        after a back-off, saying so in one line (the first, the tenth, then every hundredth)."""
        from kubernetes import watch

        o = self.options
        failures = 0
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None or kind == "pods":
                    rv = self._list(kind)
                failures = 0
                w = watch.Watch()
                for event in w.stream(
                    self._recording(kind, self._list_call(kind)),
                    **self._list_kwargs(kind),
                    resource_version=rv,
                    deserialize=False,
                    _request_timeout=(o.api_timeout_s, o.api_timeout_s),
                ):
                    if self._stop.is_set():
                        w.stop()
                        break
                    rv = self._on_event(kind, event) or rv
            except Exception as exc:  # the thread must outlive any failure of the API server
                if self._stop.is_set():  # close() cut the read (Note [Prompt close]): no failure
                    break
                if "timed out" in str(exc).lower():
                    continue
                if getattr(exc, "status", None) == 403 and kind == "nodes":
                    self._say(
                        api_error(
                            exc,
                            "cannot watch nodes (RBAC: see the ClusterRole in "
                            "docs/manager.md); preemption taints go unseen, pod "
                            "deletions are still seen",
                        )
                    )
                    return
                rv = None
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    self._say(api_error(exc, f"watching {kind} (attempt {failures})"))
                self._stop.wait(min(5.0, 0.2 * 2 ** min(failures, 5)))

    def _recording(self, kind: str, call: Any) -> Any:
        """``call``, keeping the response it returns in ``_streams`` for close(). The wrapper
        keeps ``call``'s docstring: the client's Watch reads the argument names there."""

        @functools.wraps(call)
        def opened(*args: Any, **kwargs: Any) -> Any:
            resp = call(*args, **kwargs)
            with self._lock:
                self._streams[kind] = resp
            if self._stop.is_set():  # close() ran meanwhile
                _cut(resp)
            return resp

        return opened

    def _list_call(self, kind: str) -> Any:
        return self.core.list_namespaced_pod if kind == "pods" else self.core.list_node

    def _list_kwargs(self, kind: str) -> dict[str, Any]:
        if kind == "pods":
            return {"namespace": self.options.namespace, "label_selector": self._selector(self._job_id)}
        return {}

    def _list(self, kind: str) -> str:
        """Replace the cache of ``kind`` with a fresh list; its resourceVersion."""
        started = time.monotonic()
        reply = self._list_call(kind)(
            **self._list_kwargs(kind), _preload_content=False, _request_timeout=self.options.api_timeout_s
        )
        import json

        doc = json.loads(reply.data)
        items = [i for i in doc.get("items") or [] if self._ours(kind, i)]
        with self._lock:
            if kind == "pods":
                self._cache.pods = {i["metadata"]["name"]: i for i in items}
                self._cache.listed_at = started
            else:
                self._cache.nodes = {i["metadata"]["name"]: i for i in items}
        self._act_on_nodes()
        return str((doc.get("metadata") or {}).get("resourceVersion") or "")

    def _ours(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """Whether a listed or watched object belongs here (the API filters by the label selector
        already; this keeps a server that ignores it, or another job's pods, out)."""
        if kind != "pods":
            return True
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return labels.get(MANAGED_BY[0]) == MANAGED_BY[1] and labels.get(JOB_LABEL) == label_value(
            self._job_id
        )

    def _on_event(self, kind: str, event: Mapping[str, Any]) -> str:
        """Apply one watch event to the cache; the object's resourceVersion ("" if none)."""
        obj = event.get("object") or {}
        etype = event.get("type")
        meta = obj.get("metadata") or {}
        rv = str(meta.get("resourceVersion") or "")
        name = meta.get("name")
        if etype in ("BOOKMARK", "ERROR") or not name or not self._ours(kind, obj):
            return rv
        with self._lock:
            table = self._cache.pods if kind == "pods" else self._cache.nodes
            if etype == "DELETED":
                table.pop(name, None)
                if kind == "pods":
                    self._cache.deleted.add(name)
            else:
                table[name] = dict(obj)
        self._act_on_nodes()
        return rv

    def _act_on_nodes(self) -> None:
        """Delete, gracefully, the job's pods on nodes about to go (module docstring)."""
        o = self.options
        with self._lock:
            doomed = []
            for name, pod in self._cache.pods.items():
                node = (pod.get("spec") or {}).get("nodeName")
                meta = pod.get("metadata") or {}
                if not node or node not in self._cache.nodes or name in self._cache.noticed:
                    continue
                ended = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
                if meta.get("deletionTimestamp") or ended:
                    continue
                why = preemption_reason(self._cache.nodes[node], o.preemption_taints, o.notice_on_cordon)
                if why:
                    self._cache.noticed.add(name)
                    doomed.append((name, node, why))
        for name, node, why in doomed:
            self._say(
                f"kubernetes: node {node}: {why}: deleting pod {o.namespace}/{name} with its grace period "
                f"({o.grace_period_s} s; its agent gets the notice)"
            )
            self._delete(name, None, secret=False)  # its volume stays mounted until it ends
