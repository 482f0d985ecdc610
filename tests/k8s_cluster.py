"""A Kubernetes cluster without a cloud, for the kubernetes provider's tests: kmock's Kubernetes
emulator (a real HTTP API server on loopback that the official client talks to) and a small
kubelet that runs the pods of one namespace as local process groups.

**The API server** is ``kmock.KubernetesEmulator`` (PyPI ``kmock``, by the author of Kopf) served
by aiohttp on 127.0.0.1 in a thread of the test: objects are created, patched (merge and JSON
patches), listed and watched (``?watch=true`` streams ADDED/MODIFIED/DELETED), deleted; an object
with finalizers is only marked (``deletionTimestamp``) until they are removed, as on a real API
server. What it does not do, and how this file makes up for it:

* it recognises a watch only as ``watch=true``; the official client sends ``watch=True`` (which
  the real API server accepts, Go's ``strconv.ParseBool``): :class:`_Emulator` lower-cases it;
* it has no graceful pod deletion (``deletionGracePeriodSeconds``, the kubelet confirming): the
  kubelet below puts its own finalizer on every pod it runs, so a deletion only marks the pod, the
  kubelet terminates it (preStop, SIGTERM, grace, SIGKILL) and then removes the finalizer;
* it ignores label and field selectors (the provider filters what it lists by label too), assigns
  no uid or resourceVersion (the provider's Secrets then have no owner reference; its watches fall
  back on listing again), and has no garbage collector, scheduler or pod GC (the kubelet binds pods
  to nodes and deletes the pods of a deleted node, as the pod GC does).

**The kubelet** (:class:`Kubelet`) watches pods and nodes through the official client and, on
each change (or every ``poll_s`` for process exits), reconciles: it binds a pending pod to a node
that exists, is not cordoned, whose taints it tolerates, whose labels match its nodeSelector and
that runs fewer than ``pods_per_node`` pods; it starts a bound pod's container once its Secret
volumes exist — the container's command as a local process in its own session, each volume a
directory under the pod's directory, and every path under a mount path in the command (and the
preStop hook) rewritten to that directory (there is no mount namespace); it reports the phase
(``Running``, then ``Succeeded``/``Failed`` with the exit); on a deletion it runs the preStop hook
(at most the grace period), sends SIGTERM to the process group, SIGKILL at the end of the grace
period, and removes its finalizer; a node that is deleted takes its pods' processes down at once
(SIGKILL: the VM vanished) and its pods with it. :meth:`Kubelet.close` kills whatever still runs.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock
from kubernetes import client, watch

ROOT = Path(__file__).resolve().parents[1]
FINALIZER = "varuna.test/kubelet"


class _Emulator(kmock.KubernetesEmulator):
    async def __call__(self, raw_request: Any) -> Any:
        if raw_request.query.get("watch") == "True":  # the official client's spelling
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.update_query(watch="true"))
        return await super().__call__(raw_request)


class ApiServer:
    """kmock's emulator on 127.0.0.1, served from its own thread (an asyncio loop)."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self.url = ""
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or not self.url:
            raise RuntimeError(f"kmock did not start: {self.error!r}")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by __init__
            self.error = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with _Emulator() as emulator, kmock.Server(emulator) as server:
            for resource in ("v1/pods", "v1/secrets", "v1/nodes"):
                emulator.resources[resource] = {}
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def close(self) -> None:
        if self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def api(self, timeout_s: float = 10.0) -> client.CoreV1Api:
        cfg = client.Configuration()
        cfg.host = self.url
        return client.CoreV1Api(client.ApiClient(cfg))

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig for this server (no credentials: the emulator asks for none)."""
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters:\n- name: fake\n  cluster:\n    server: {self.url}\n"
            "contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n"
            f"    namespace: {namespace}\n"
            "users:\n- name: fake\n  user: {}\n"
        )
        return path

    def objects(self, plural: str) -> list[tuple[str, str, bool]]:
        """Every object of a resource the server ever held: (namespace, name, deleted)."""
        out = []
        for (resource, namespace, name), obj in list(self.emulator.objects.items()):
            if resource.plural == plural:
                out.append((namespace or "", name, bool(obj.deleted)))
        return out


@dataclass
class _Running:
    """A pod's container on this kubelet."""

    name: str
    node: str
    popen: subprocess.Popen
    dir: Path
    mounts: dict[str, str]
    env: dict[str, str]
    pre_stop: list[str] = field(default_factory=list)
    terminating: bool = False
    reported: bool = False


class Kubelet:
    """Runs the pods of ``namespace`` as local process groups (module docstring)."""

    def __init__(
        self, server: ApiServer, namespace: str, root: Path, *, pods_per_node: int = 1, poll_s: float = 0.2
    ) -> None:
        self.server = server
        self.api = server.api()
        self.namespace = namespace
        self.root = root
        self.pods_per_node = pods_per_node
        self.poll_s = poll_s
        self.log: list[str] = []
        self.running: dict[str, _Running] = {}
        self.started: list[str] = []  # every pod it ever started
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, args=("pods",), name="kubelet-pods", daemon=True),
            threading.Thread(target=self._watch, args=("nodes",), name="kubelet-nodes", daemon=True),
            threading.Thread(target=self._loop, name="kubelet", daemon=True),
        ]
        self._terminators: list[threading.Thread] = []
        for t in self._threads:
            t.start()

    def say(self, text: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {text}")

    # -- watching ------------------------------------------------------------------------------

    def _watch(self, kind: str) -> None:
        call = (
            (self.api.list_namespaced_pod, (self.namespace,)) if kind == "pods" else (self.api.list_node, ())
        )
        while not self._stop.is_set():
            try:
                for _ in watch.Watch().stream(call[0], *call[1], deserialize=False, _request_timeout=(2, 2)):
                    self._dirty.set()
                    if self._stop.is_set():
                        break
            except Exception:  # a quiet stream times out: watch again
                self._dirty.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(self.poll_s)
            self._dirty.clear()
            if self._stop.is_set():
                break
            try:
                self.reconcile()
            except Exception as exc:  # say it; the next change tries again
                self.say(f"reconcile failed: {type(exc).__name__}: {exc}")

    # -- reconciling ---------------------------------------------------------------------------

    def reconcile(self) -> None:
        pods = self.api.list_namespaced_pod(self.namespace, _preload_content=False)
        nodes = self.api.list_node(_preload_content=False)
        import json

        pods = [p for p in json.loads(pods.data).get("items") or []]
        nodes = {n["metadata"]["name"]: n for n in json.loads(nodes.data).get("items") or []}
        bound: dict[str, int] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                bound[node] = bound.get(node, 0) + 1
        for pod in pods:
            self._reconcile_pod(pod, nodes, bound)
        self._report_exits()

    def _reconcile_pod(self, pod: dict, nodes: dict[str, dict], bound: dict[str, int]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        name = meta["name"]
        node = spec.get("nodeName")
        with self._lock:
            running = self.running.get(name)
        if meta.get("deletionTimestamp"):
            if running is not None and not running.terminating:
                running.terminating = True
                grace = float(spec.get("terminationGracePeriodSeconds", 30))
                t = threading.Thread(target=self._terminate, args=(running, grace), daemon=True)
                self._terminators.append(t)
                t.start()
            elif running is None and FINALIZER in (meta.get("finalizers") or []):
                self._release(name)
            return
        if node and node not in nodes:  # the node is gone: so is what ran there (pod GC)
            if running is not None:
                self._kill(running, "its node was deleted")
            self.say(f"pod {name}: node {node} deleted: pod deleted")
            self._release(name)
            self._delete(name)
            return
        if not node:
            chosen = self._schedule(pod, nodes, bound)
            if chosen:
                bound[chosen] = bound.get(chosen, 0) + 1
                self.api.patch_namespaced_pod(
                    name,
                    self.namespace,
                    {
                        "metadata": {"finalizers": [FINALIZER]},
                        "spec": {"nodeName": chosen},
                        "status": {"phase": "Pending"},
                    },
                )
                self.say(f"pod {name}: bound to {chosen}")
            return
        if running is None and name not in self.started:
            self._start(pod, node)

    def _schedule(self, pod: dict, nodes: dict[str, dict], bound: dict[str, int]) -> str:
        spec = pod.get("spec") or {}
        selector = spec.get("nodeSelector") or {}
        tolerated = spec.get("tolerations") or []
        for name, node in sorted(nodes.items()):
            nspec = node.get("spec") or {}
            labels = (node.get("metadata") or {}).get("labels") or {}
            if nspec.get("unschedulable") or bound.get(name, 0) >= self.pods_per_node:
                continue
            if any(labels.get(k) != v for k, v in selector.items()):
                continue
            taints = [t for t in nspec.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
            if all(_tolerates(tolerated, t) for t in taints):
                return name
        return ""

    def _start(self, pod: dict, node: str) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        name = meta["name"]
        pod_dir = self.root / name
        mounts: dict[str, str] = {}
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        [container] = spec["containers"]
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            host = pod_dir / "volumes" / mount["name"]
            host.mkdir(parents=True, exist_ok=True)
            if "secret" in volume:
                try:
                    secret = self.api.read_namespaced_secret(volume["secret"]["secretName"], self.namespace)
                except client.ApiException as exc:
                    if exc.status == 404:
                        return  # ContainerCreating until the Secret exists
                    raise
                for key, value in (secret.data or {}).items():
                    path = host / key
                    path.write_bytes(base64.b64decode(value))
                    path.chmod(volume["secret"].get("defaultMode", 0o644))
            mounts[mount["mountPath"]] = str(host)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.update({e["name"]: e.get("value", "") for e in container.get("env") or []})
        argv = [_mapped(a, mounts) for a in container["command"] + container.get("args", [])]
        hook = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command") or []
        log = open(pod_dir / "container.log", "ab")
        try:
            popen = subprocess.Popen(
                argv,
                cwd=pod_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            log.close()
        with self._lock:
            self.running[name] = _Running(
                name=name,
                node=node,
                popen=popen,
                dir=pod_dir,
                mounts=mounts,
                env=env,
                pre_stop=[_mapped(a, mounts) for a in hook],
            )
            self.started.append(name)
        self.api.patch_namespaced_pod(
            name, self.namespace, {"status": {"phase": "Running", "podIP": "127.0.0.1"}}
        )
        self.say(f"pod {name}: started on {node} (pid {popen.pid})")

    def _report_exits(self) -> None:
        with self._lock:
            ended = [
                r
                for r in self.running.values()
                if not r.terminating and not r.reported and r.popen.poll() is not None
            ]
        for r in ended:
            r.reported = True
            phase = "Succeeded" if r.popen.returncode == 0 else "Failed"
            self.say(f"pod {r.name}: exited {r.popen.returncode} ({phase})")
            try:
                self.api.patch_namespaced_pod(r.name, self.namespace, {"status": {"phase": phase}})
            except client.ApiException:
                pass

    def _terminate(self, r: _Running, grace_s: float) -> None:
        """Graceful termination: preStop, SIGTERM, SIGKILL at the end of the grace period."""
        deadline = time.monotonic() + grace_s
        if r.popen.poll() is None and r.pre_stop:
            self.say(f"pod {r.name}: terminating (grace {grace_s:g} s): preStop")
            try:
                subprocess.run(
                    r.pre_stop,
                    cwd=r.dir,
                    env=r.env,
                    timeout=max(0.1, deadline - time.monotonic()),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                pass
        if r.popen.poll() is None:
            self.say(f"pod {r.name}: SIGTERM")
            _signal_group(r.popen.pid, signal.SIGTERM)
            try:
                r.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(r, "grace period over")
        self.say(f"pod {r.name}: terminated ({r.popen.returncode})")
        with self._lock:
            self.running.pop(r.name, None)
        self._release(r.name)

    def _kill(self, r: _Running, why: str) -> None:
        self.say(f"pod {r.name}: SIGKILL ({why})")
        _signal_group(r.popen.pid, signal.SIGKILL)
        try:
            r.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        with self._lock:
            self.running.pop(r.name, None)

    def _release(self, name: str) -> None:
        try:
            self.api.patch_namespaced_pod(name, self.namespace, {"metadata": {"finalizers": []}})
        except client.ApiException:
            pass

    def _delete(self, name: str) -> None:
        try:
            self.api.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        except client.ApiException:
            pass

    # -- what tests do -------------------------------------------------------------------------

    def pod_on(self, node: str) -> str:
        """The pod running on ``node`` ("" when none)."""
        with self._lock:
            return next((r.name for r in self.running.values() if r.node == node and not r.terminating), "")

    def node_of(self, pod: str) -> str:
        with self._lock:
            r = self.running.get(pod)
            return r.node if r is not None else ""

    def close(self) -> None:
        """Stop watching and kill every process still running (a failed test leaves none)."""
        self._stop.set()
        self._dirty.set()
        for t in self._threads:
            t.join(10)
        with self._lock:
            left = list(self.running.values())
        for r in left:
            self._kill(r, "kubelet closing")
        for t in self._terminators:
            t.join(60)
        self.api.api_client.close()


def _tolerates(tolerations: list[dict], taint: dict) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        if tol.get("operator") == "Exists" and (not tol.get("key") or tol["key"] == taint.get("key")):
            return True
        if tol.get("key") == taint.get("key") and str(tol.get("value", "")) == str(
            taint.get("value", "") or ""
        ):
            return True
    return False


def _mapped(arg: str, mounts: dict[str, str]) -> str:
    for path, host in mounts.items():
        if arg == path or arg.startswith(path + "/"):
            return host + arg[len(path) :]
    return arg


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Cluster:
    """The API server and a kubelet for ``namespace``, with the nodes a test names."""

    def __init__(self, root: Path, namespace: str = "varuna", **kubelet: Any) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.server = ApiServer()
        self.api = self.server.api()
        self.kubeconfig = self.server.write_kubeconfig(root / "kubeconfig", namespace)
        self.kubelet = Kubelet(self.server, namespace, root / "pods", **kubelet)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        self.api.create_node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels or {}},
                "spec": {},
            }
        )

    def taint(self, node: str, key: str, effect: str = "NoSchedule") -> None:
        current = self.api.read_node(node).spec.taints or []
        taints = [{"key": t.key, "value": t.value, "effect": t.effect} for t in current]
        self.api.patch_node(node, {"spec": {"taints": [*taints, {"key": key, "effect": effect}]}})

    def delete_node(self, node: str) -> None:
        self.api.delete_node(node)

    def pods(self) -> list[dict]:
        """The pods of the namespace now (JSON)."""
        import json

        reply = self.api.list_namespaced_pod(self.namespace, _preload_content=False)
        return list(json.loads(reply.data).get("items") or [])

    def secrets(self) -> list[str]:
        return [s.metadata.name for s in self.api.list_namespaced_secret(self.namespace).items]

    def close(self) -> None:
        self.kubelet.close()
        self.api.api_client.close()
        self.server.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":  # a quick look: python tests/k8s_cluster.py
    c = Cluster(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/k8s-cluster"))
    print(c.server.url)
    c.close()
