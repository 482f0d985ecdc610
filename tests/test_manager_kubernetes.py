"""The kubernetes provider and the pod termination notice source, without a cluster.

* The notice source (manager/agent/pod_notices.py) on the documents its preStop hook writes: the
  real hook's document, a recorded one, approval, and the bad cases (no directory, a malformed
  document, not a path) each one line on stderr and no notice, never an exception.
* The provider's options, manifests (the token only in the Secret, never on the command line or in
  the pod) and per-type options; node documents as GKE, the cluster autoscaler, Karpenter and the
  AWS Node Termination Handler write them, judged preemption or not.
* The provider with the real ``kubernetes`` client against kmock's emulated API server on
  loopback (tests/k8s_cluster.py, no kubelet): pods and Secrets made and labelled, pods gone
  (deleted, ended) versus terminating, a node tainted or cordoned → its pods deleted gracefully
  (the negative controls: a spot pool's own taint, cordons ignored when asked), cleanup, a
  restarted manager's sweep, a stale pod of the same name, an unreachable or unusable API server
  (one line, no crash).

No real cluster is reached (docs/manager.md, "kubernetes").
"""

from __future__ import annotations

import base64
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from manager.agent.notices import load_notice_source
from manager.agent.pod_notices import (
    APPROVED_FILE,
    NOTICE_FILE,
    PodTerminationNotices,
    main,
    parse_notice,
    pre_stop,
)
from manager.providers.agent_start import AgentStart, agent_argv
from manager.providers.base import ProviderContext
from manager.providers.registry import provider_entry

TOKEN = "k8s-test-token-0123456789abcdef"


# -- the notice source ------------------------------------------------------------------------


def test_the_pre_stop_hook_document_is_the_agents_notice(tmp_path):
    assert pre_stop(str(tmp_path), 0, "job-vm3") is False  # nobody approved within 0 s
    doc = json.loads((tmp_path / NOTICE_FILE).read_text())
    assert doc["event_type"] == "PodTermination" and doc["pod"] == "job-vm3"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["not_before"])
    [notice] = PodTerminationNotices(str(tmp_path), "job-vm3").poll()
    assert notice.event_id == doc["event_id"] and notice.event_type == "PodTermination"
    assert notice.not_before == doc["not_before"] and "job-vm3" in notice.description


RECORDED = {
    "event_id": "gpt-k8s-1a2b3c-vm3-1795843200",
    "event_type": "PodTermination",
    "not_before": "2026-11-28T10:50:28Z",
    "grace_s": 28,
    "pod": "gpt-k8s-1a2b3c-vm3",
}


def test_a_recorded_document_and_the_registry_entry_name_the_same_source(tmp_path):
    (tmp_path / NOTICE_FILE).write_text(json.dumps(RECORDED))
    spec = provider_entry("kubernetes").notice_source
    assert spec == "manager.agent.pod_notices:PodTerminationNotices"
    source = load_notice_source(spec, url=f"file://{tmp_path}", vm_name="gpt-k8s-1a2b3c-vm3")
    [notice] = source.poll()
    assert (notice.event_id, notice.not_before) == (RECORDED["event_id"], RECORDED["not_before"])
    assert parse_notice({"event_type": "PodTermination"}) is None  # no event id: not a notice


def test_approval_releases_the_waiting_hook(tmp_path):
    result: list[bool] = []
    hook = threading.Thread(target=lambda: result.append(pre_stop(str(tmp_path), 120, "p")))
    hook.start()
    source = PodTerminationNotices(str(tmp_path), "p")
    notices = []
    while hook.is_alive() and not notices:  # the hook writes its notice first
        notices = source.poll()
        hook.join(0.05)
    assert notices and source.approve(notices[0].event_id)
    hook.join(60)
    assert result == [True], "approved long before the 120 s wait"
    assert (tmp_path / APPROVED_FILE).read_text() == notices[0].event_id


def test_without_approval_the_hook_gives_up_at_its_wait(tmp_path):
    ticks = iter([0.0, 5.0, 11.0])  # a clock: start, one poll inside the wait, then past it
    assert pre_stop(str(tmp_path), 10, "p", clock=lambda: next(ticks)) is False
    assert (tmp_path / NOTICE_FILE).exists() and not (tmp_path / APPROVED_FILE).exists()


def test_bad_notice_directories_give_one_line_and_no_notice(tmp_path, capsys):
    missing = PodTerminationNotices(str(tmp_path / "nope"), "p")
    assert missing.poll() == [] and missing.poll() == []
    not_a_path = PodTerminationNotices("http://169.254.169.254/", "p")
    assert not_a_path.poll() == [] and not_a_path.approve("e") is False
    (tmp_path / NOTICE_FILE).write_text("{not json")
    garbled = PodTerminationNotices(str(tmp_path), "p")
    assert garbled.poll() == [] and garbled.poll() == []
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3, lines  # one per problem, not one per poll
    assert "is not a directory" in lines[0] and "not an absolute directory path" in lines[1]
    assert "holds no notice" in lines[2]


def test_the_hook_command_line(tmp_path, capsys):
    assert main(["pre-stop", "--dir", str(tmp_path), "--wait", "0", "--pod", "p"]) == 0
    assert json.loads((tmp_path / NOTICE_FILE).read_text())["pod"] == "p"
    assert main(["pre-stop", "--dir", "relative", "--wait", "0"]) == 1
    assert capsys.readouterr().err.count("\n") == 2  # one line each


# -- options, manifests, node documents ------------------------------------------------------

kubernetes_provider = pytest.importorskip("manager.providers.kubernetes")
KubernetesProvider = kubernetes_provider.KubernetesProvider
Options = kubernetes_provider.KubernetesProviderOptions


def _context(tmp_path: Path) -> ProviderContext:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    return ProviderContext(manager_address="10.0.0.5:7878", token_file=str(token), state_dir=str(tmp_path))


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"image": "i", "vm_size": "x"}, "unknown kubernetes option(s) vm_size"),
        ({}, "kubernetes needs image"),
        ({"image": "i", "namespace": "Not_A_Namespace"}, "namespace 'Not_A_Namespace' is not a namespace"),
        ({"image": "i", "gpus": -1}, "gpus must be an integer >= 0"),
        ({"image": "i", "grace_period_s": 2}, "grace_period_s must exceed 2 s"),
        ({"image": "i", "node_selector": {"pool": 1}}, "node_selector must be a table of strings"),
        ({"image": "i", "tolerations": {"key": "x"}}, "tolerations must be a list of tables"),
        ({"image": "i", "api_timeout_s": 0}, "api_timeout_s must be a number > 0"),
    ],
)
def test_bad_options_are_refused_in_one_line(options, words):
    with pytest.raises(ValueError) as err:
        provider_entry("kubernetes").parse_options(options)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_per_type_options_are_the_registrys():
    entry = provider_entry("kubernetes")
    job = {"image": "i"}
    entry.check_type_options("spot", {"node_selector": {"pool": "spot"}, "gpus": 8}, job)
    with pytest.raises(ValueError, match="namespace is not a per-type kubernetes option"):
        entry.check_type_options("spot", {"namespace": "other"}, job)
    with pytest.raises(ValueError, match="vm_types spot: provider_options.gpus must be"):
        entry.check_type_options("spot", {"gpus": "eight"}, job)


def test_the_pod_runs_the_agent_and_the_token_stays_in_the_secret(tmp_path):
    opts = Options.from_dict(
        {
            "image": "reg/varuna:1",
            "namespace": "ml",
            "cpu": "8",
            "memory": "60Gi",
            "gpus": 1,
            "grace_period_s": 30,
        }
    )
    context = _context(tmp_path)
    provider = KubernetesProvider(opts, context, client=object())
    spot = {
        "vm_type": "spot",
        "node_selector": {"cloud.google.com/gke-spot": "true"},
        "tolerations": [
            {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        ],
        "gpus": 8,
    }
    pod = provider.pod_manifest("job-1", "job-1-vm3", 8, opts.typed(spot), spot)
    text = json.dumps(pod)
    assert TOKEN not in text and base64.b64encode(TOKEN.encode()).decode() not in text
    [container] = pod["spec"]["containers"]
    expected = agent_argv(
        AgentStart(
            python="python3",
            manager="10.0.0.5:7878",
            token_file="/var/run/secrets/varuna/token",
            vm_id="job-1-vm3",
            job_id="job-1",
            slots=8,
            log_dir="/var/log/varuna",
            fence_timeout_s=context.fence_timeout_s,  # the pod's agent fences its workers when cut off
            silence_probe_after_s=context.silence_probe_after_s,
            notice_source=provider_entry("kubernetes").notice_source,
            notice_url="/var/run/varuna/notice",
            vm_name="job-1-vm3",
            approve_notices=True,
            standby=8,
        )
    )
    assert container["command"] == expected
    assert "--fence-timeout" in expected  # the expectation is not vacuous: the provider passes the fence
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[mounts["/var/run/secrets/varuna"]]["secret"]["secretName"] == "job-1-vm3"
    assert "emptyDir" in volumes[mounts["/var/run/varuna/notice"]]
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    assert (
        hook[1:4] == ["-m", "manager.agent.pod_notices", "pre-stop"]
        and hook[hook.index("--wait") + 1] == "28"
    )
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30 and pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert pod["spec"]["tolerations"] == spot["tolerations"]
    assert container["resources"]["limits"] == {"cpu": "8", "memory": "60Gi", "nvidia.com/gpu": "8"}
    assert pod["metadata"]["labels"]["varuna.io/vm-type"] == "spot"
    secret = provider.secret_manifest("job-1", "job-1-vm3", {"metadata": {"name": "job-1-vm3", "uid": "u-1"}})
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "job-1-vm3", "uid": "u-1"}
    ]
    assert secret["metadata"]["labels"].items() <= pod["metadata"]["labels"].items()


def test_pod_names_are_dns_labels_and_stay_distinct():
    names = {
        kubernetes_provider.pod_name(v) for v in ("Job_A-vm1", "job-a-vm1", "job_a-vm1", "x" * 90 + "-vm1")
    }
    assert len(names) == 4
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 63 for n in names)


# Node documents as the platforms write them (the parts that matter).
GKE_TERMINATING = {
    "metadata": {"name": "gke-spot-1", "labels": {"cloud.google.com/gke-spot": "true"}},
    "spec": {"taints": [{"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"}]},
}
CA_SCALE_DOWN = {
    "metadata": {"name": "ip-10-0-1-7"},
    "spec": {
        "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1732791000", "effect": "NoSchedule"}]
    },
}
KARPENTER = {
    "metadata": {"name": "ip-10-0-1-8"},
    "spec": {"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]},
}
NTH_SPOT_ITN = {
    "metadata": {"name": "ip-10-0-1-9"},
    "spec": {
        "unschedulable": True,
        "taints": [{"key": "aws-node-termination-handler/spot-itn", "value": "abc", "effect": "NoSchedule"}],
    },
}
CORDONED = {
    "metadata": {"name": "n1"},
    "spec": {
        "unschedulable": True,
        "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
    },
}
AKS_SPOT = {
    "metadata": {"name": "aks-spot-1"},
    "spec": {
        "taints": [{"key": "kubernetes.azure.com/scalesetpriority", "value": "spot", "effect": "NoSchedule"}]
    },
}
NOT_READY = {
    "metadata": {"name": "n2"},
    "spec": {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]},
}


@pytest.mark.parametrize(
    ("node", "cordon", "reason"),
    [
        (GKE_TERMINATING, True, "taint cloud.google.com/impending-node-termination"),
        (CA_SCALE_DOWN, True, "taint ToBeDeletedByClusterAutoscaler"),
        (KARPENTER, True, "taint karpenter.sh/disrupted"),
        (NTH_SPOT_ITN, False, "taint aws-node-termination-handler/spot-itn"),
        (CORDONED, True, "taint node.kubernetes.io/unschedulable"),
        (CORDONED, False, ""),
        (AKS_SPOT, True, ""),  # a spot pool's own taint: where the job runs, not a notice
        (NOT_READY, True, ""),  # not ready may come back; a lost node is seen as lost pods
    ],
)
def test_node_documents_judged_preemption_or_not(node, cordon, reason):
    taints = kubernetes_provider.PREEMPTION_TAINTS
    assert kubernetes_provider.preemption_reason(node, taints, cordon) == reason


# -- against kmock's API server ---------------------------------------------------------------


@dataclass
class VM:
    vm_id: str
    job_id: str
    state: str = "up"
    ref: dict = field(default_factory=dict)


@pytest.fixture
def server():
    pytest.importorskip("kmock")
    from k8s_cluster import ApiServer

    srv = ApiServer()
    yield srv
    srv.close()


def _provider(tmp_path, server, **options) -> tuple[KubernetesProvider, list[str]]:
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    opts = Options.from_dict(
        {
            "image": "i",
            "namespace": "ml",
            "kubeconfig": str(kubeconfig),
            "api_timeout_s": 5,
            "grace_period_s": 30,
            **options,
        }
    )
    said: list[str] = []
    return KubernetesProvider(opts, _context(tmp_path), say=said.append), said


def _pods(api) -> dict[str, dict]:
    reply = api.list_namespaced_pod("ml", _preload_content=False)
    return {p["metadata"]["name"]: p for p in json.loads(reply.data)["items"]}


def _wait(condition, what: str, timeout_s: float = 30.0):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_manager_local import wait_for

    return wait_for(condition, timeout_s, what, poll_s=0.05)


def test_pods_and_secrets_made_then_gone_or_terminating(tmp_path, server):
    provider, _ = _provider(tmp_path, server)
    api = server.api()
    try:
        new = provider.create_vms("job-1", ["job-1-vm1", "job-1-vm2", "job-1-vm3"], 1, created_so_far=0)
        assert [n.ref for n in new] == [{"pod": f"job-1-vm{i}", "namespace": "ml"} for i in (1, 2, 3)]
        pods = _pods(api)
        assert sorted(pods) == ["job-1-vm1", "job-1-vm2", "job-1-vm3"]
        assert all(p["metadata"]["labels"]["varuna.io/job"] == "job-1" for p in pods.values())
        secret = api.read_namespaced_secret("job-1-vm1", "ml")
        assert base64.b64decode(secret.data["token"]).decode() == TOKEN
        vms = [VM(n.vm_id, "job-1", ref=n.ref) for n in new]
        assert provider.gone_vms(vms) == []  # all there (and the first list may not be in yet)
        # vm1: deleted outright (no finalizer: gone at once); vm2: ends Failed; vm3: terminating.
        api.patch_namespaced_pod("job-1-vm3", "ml", {"metadata": {"finalizers": ["test/hold"]}})
        api.delete_namespaced_pod("job-1-vm1", "ml")
        api.patch_namespaced_pod("job-1-vm2", "ml", {"status": {"phase": "Failed"}})
        api.delete_namespaced_pod("job-1-vm3", "ml", grace_period_seconds=30)
        _wait(lambda: provider.gone_vms(vms) == ["job-1-vm1", "job-1-vm2"], "vm1 and vm2 gone")
        assert _pods(api)["job-1-vm3"]["metadata"].get("deletionTimestamp")  # in its grace period
        api.patch_namespaced_pod("job-1-vm3", "ml", {"metadata": {"finalizers": []}})
        _wait(lambda: provider.gone_vms(vms) == ["job-1-vm1", "job-1-vm2", "job-1-vm3"], "vm3 gone")
        for vm in vms:
            provider.delete_vm(vm)
            provider.delete_vm(vm)  # idempotent
        assert _pods(api) == {} and api.list_namespaced_secret("ml").items == []
    finally:
        provider.close()
        api.api_client.close()


def test_a_tainted_or_cordoned_node_has_its_pods_deleted_with_their_grace(tmp_path, server):
    provider, said = _provider(tmp_path, server)
    api = server.api()
    try:
        for n in ("n1", "n2", "n3"):
            api.create_node({"metadata": {"name": n}, "spec": {}})
        new = provider.create_vms("job-1", ["job-1-vm1", "job-1-vm2", "job-1-vm3"], 1, created_so_far=0)
        for i, n in enumerate(("n1", "n2", "n3"), start=1):  # bound, held by a finalizer (as a kubelet would)
            api.patch_namespaced_pod(
                f"job-1-vm{i}", "ml", {"metadata": {"finalizers": ["test/hold"]}, "spec": {"nodeName": n}}
            )
        vms = [VM(n.vm_id, "job-1", ref=n.ref) for n in new]
        _wait(
            lambda: provider.gone_vms(vms) == [] and provider._cache.listed_at is not None, "the first list"
        )
        # Negative control first: a spot pool's own taint is no notice (the same watch, in order).
        api.patch_node(
            "n2",
            {
                "spec": {
                    "taints": [
                        {
                            "key": "kubernetes.azure.com/scalesetpriority",
                            "value": "spot",
                            "effect": "NoSchedule",
                        }
                    ]
                }
            },
        )
        api.patch_node(
            "n1", {"spec": {"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}}
        )
        _wait(lambda: _pods(api)["job-1-vm1"]["metadata"].get("deletionTimestamp"), "vm1's graceful deletion")
        assert not _pods(api)["job-1-vm2"]["metadata"].get("deletionTimestamp")
        api.patch_node("n3", {"spec": {"unschedulable": True}})
        _wait(lambda: _pods(api)["job-1-vm3"]["metadata"].get("deletionTimestamp"), "vm3's graceful deletion")
        assert not _pods(api)["job-1-vm2"]["metadata"].get("deletionTimestamp")
        assert [x.split(": ")[1:3] for x in said] == [
            ["node n1", "taint karpenter.sh/disrupted"],
            ["node n3", "cordoned (unschedulable)"],
        ]
        # The graceful delete kept the Secret (still mounted); a notice is not a loss.
        assert {s.metadata.name for s in api.list_namespaced_secret("ml").items} == {
            "job-1-vm1",
            "job-1-vm2",
            "job-1-vm3",
        }
        assert provider.gone_vms(vms) == []
    finally:
        provider.close()
        api.api_client.close()


def test_cordons_are_ignored_when_asked(tmp_path, server):
    provider, said = _provider(tmp_path, server, notice_on_cordon=False)
    api = server.api()
    try:
        api.create_node({"metadata": {"name": "n1"}, "spec": {}})
        api.create_node({"metadata": {"name": "n2"}, "spec": {}})
        provider.create_vms("job-1", ["job-1-vm1", "job-1-vm2"], 1, created_so_far=0)
        for i in (1, 2):
            api.patch_namespaced_pod(
                f"job-1-vm{i}",
                "ml",
                {"metadata": {"finalizers": ["test/hold"]}, "spec": {"nodeName": f"n{i}"}},
            )
        api.patch_node("n1", {"spec": {"unschedulable": True}})
        api.patch_node(
            "n2", {"spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}}
        )
        _wait(lambda: _pods(api)["job-1-vm2"]["metadata"].get("deletionTimestamp"), "vm2's graceful deletion")
        assert not _pods(api)["job-1-vm1"]["metadata"].get("deletionTimestamp")
        assert len(said) == 1
    finally:
        provider.close()
        api.api_client.close()


def test_a_restarted_manager_sweeps_what_no_live_vm_names(tmp_path, server):
    first, _ = _provider(tmp_path, server)
    api = server.api()
    try:
        new = first.create_vms("job-1", ["job-1-vm1", "job-1-vm2"], 1, created_so_far=0)
        first.close()  # the manager dies; its pods stay
        other, _ = _provider(tmp_path, server)
        other.create_vms("job-2", ["job-2-vm1"], 1, created_so_far=0)  # another job's pod
        other.close()
        again, said = _provider(tmp_path, server, sweep_interval_s=0.01)
        vms = [VM(new[0].vm_id, "job-1", ref=new[0].ref)]  # vm2 was never recorded (died mid-request)
        _wait(lambda: again.gone_vms(vms) == [] and "job-1-vm2" not in _pods(api), "the sweep")
        assert sorted(_pods(api)) == ["job-1-vm1", "job-2-vm1"]  # its live VM's pod, another job's
        assert {s.metadata.name for s in api.list_namespaced_secret("ml").items} == {"job-1-vm1", "job-2-vm1"}
        assert any("deleting pod ml/job-1-vm2" in x for x in said)
        again.close()
    finally:
        api.api_client.close()


def test_a_stale_pod_of_the_same_name_is_replaced_on_the_next_request(tmp_path, server):
    provider, _ = _provider(tmp_path, server)
    api = server.api()
    try:
        api.create_namespaced_pod(
            "ml", {"metadata": {"name": "job-1-vm1"}, "spec": {"containers": [{"name": "c", "image": "old"}]}}
        )
        with pytest.raises(RuntimeError) as err:
            provider.create_vms("job-1", ["job-1-vm1"], 1, created_so_far=0)
        assert "cannot create pod ml/job-1-vm1: 409" in str(err.value) and "\n" not in str(err.value)
        provider.create_vms("job-1", ["job-1-vm1"], 1, created_so_far=0)
        assert _pods(api)["job-1-vm1"]["spec"]["containers"][0]["image"] == "i"
    finally:
        provider.close()
        api.api_client.close()


def test_close_cuts_the_watches_reads_at_once(tmp_path, server):
    """Note [Prompt close]: quiet watches sit in a read that ends only after api_timeout_s;
    close() must not wait for it (a manager stopping would hang up to a minute here)."""
    provider, said = _provider(tmp_path, server, api_timeout_s=60)
    try:
        provider.create_vms("job-1", ["job-1-vm1"], 1, created_so_far=0)
        _wait(lambda: provider._cache.listed_at is not None and len(provider._streams) == 2, "watches open")
        threads = list(provider._threads)
    finally:
        started = time.monotonic()
        provider.close()
        took = time.monotonic() - started
    assert not any(t.is_alive() for t in threads)
    assert took < 30, f"close() waited {took:.1f} s for the watches' reads"
    assert said == []  # a read cut by close() is no failure of the API server


def test_an_unreachable_or_unusable_api_server_is_one_line(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from manager.common.procs import find_free_port

    port = find_free_port("127.0.0.1")  # nothing listens there
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: c\n  cluster:\n"
        f"    server: http://127.0.0.1:{port}\n"
        "contexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n"
        "users:\n- name: u\n  user: {}\n"
    )
    opts = Options.from_dict({"image": "i", "kubeconfig": str(kubeconfig), "api_timeout_s": 1})
    said: list[str] = []
    provider = KubernetesProvider(opts, _context(tmp_path), say=said.append)
    try:
        with pytest.raises(RuntimeError) as err:
            provider.create_vms("job-1", ["job-1-vm1"], 1, created_so_far=0)
        assert "cannot reach the API server" in str(err.value) and "\n" not in str(err.value)
        assert provider.gone_vms([VM("job-1-vm1", "job-1", ref={"pod": "job-1-vm1"})]) == []
        _wait(lambda: len(said) >= 2, "the watches to say why they fail")
        assert all("\n" not in x and "cannot reach the API server" in x for x in said)
    finally:
        provider.close()
    bad = KubernetesProvider(
        Options.from_dict({"image": "i", "kubeconfig": str(tmp_path / "missing")}),
        _context(tmp_path),
        say=said.append,
    )
    try:
        with pytest.raises(RuntimeError, match="kubernetes: cannot use kubeconfig .*missing"):
            bad.create_vms("job-1", ["job-1-vm1"], 1, created_so_far=0)
        assert bad.gone_vms([VM("job-1-vm1", "job-1", ref={"pod": "job-1-vm1"})]) == []
    finally:
        bad.close()
