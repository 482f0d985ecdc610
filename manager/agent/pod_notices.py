"""Kubernetes pod termination as an eviction notice: the pod's ``preStop`` hook announces it, the
agent acts on it within the pod's grace period, and approving it lets the kubelet go on.

Note [Pod termination notice]: when a pod is deleted with a grace period — ``kubectl delete``, an
eviction by ``kubectl drain`` / the cluster autoscaler / Karpenter / a node termination handler,
the kubelet's graceful node shutdown on a GKE Spot VM, or the manager itself when it sees the
node tainted for preemption (manager/providers/kubernetes.py) — the kubelet first runs the
container's ``preStop`` hook and only sends SIGTERM when the hook returns, SIGKILL when the pod's
``terminationGracePeriodSeconds`` are spent (the hook's time counts against them). The kubernetes
provider's pods run, as that hook::

    python -m manager.agent.pod_notices pre-stop --dir /var/run/varuna/notice --wait 28

which writes ``notice.json`` into an ``emptyDir`` the agent's container shares, then waits until
the agent writes ``approved`` there (its workers checkpointed and exited) or ``--wait`` seconds
passed. The agent polls the directory with :class:`PodTerminationNotices` (its notice source,
``--notice-url`` = the directory): a notice makes it stop its workers gracefully (or hand over,
live morph) and report the notice at once; ``approve`` writes ``approved``; the hook returns; the
kubelet's SIGTERM then ends the agent (its normal shutdown). SIGTERM itself is not the notice:
for the agent it means "stop now" everywhere else, and the hook gives the notice *before* it.

The document (written atomically, one JSON object)::

    {"event_id": "varuna-job-vm3-1732791000", "event_type": "PodTermination",
     "not_before": "2026-11-28T10:50:28Z", "grace_s": 28, "pod": "varuna-job-vm3"}

``not_before`` is when the hook stops waiting (the kubelet's SIGTERM comes then at the latest).
A directory that does not exist or a document that does not parse is one line on stderr (once
per problem) and no notice: the agent never stops for a notice source's fault.

    >>> parse_notice({"event_id": "e1", "event_type": "PodTermination", "not_before": "t"}).event_id
    'e1'
    >>> parse_notice({"event_type": "PodTermination"}) is None
    True
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from manager.agent.notices import Notice

__all__ = [
    "APPROVED_FILE",
    "DEFAULT_NOTICE_DIR",
    "EVENT_TYPE",
    "NOTICE_FILE",
    "PodTerminationNotices",
    "main",
    "parse_notice",
    "pre_stop",
]

#: Where the kubernetes provider mounts the ``emptyDir`` the hook and the agent share.
DEFAULT_NOTICE_DIR = "/var/run/varuna/notice"
NOTICE_FILE = "notice.json"
APPROVED_FILE = "approved"
EVENT_TYPE = "PodTermination"
#: How often the hook looks for the agent's approval.
APPROVAL_POLL_S = 0.2


def parse_notice(document: Any) -> Notice | None:
    """The notice in a hook's document; None when it is not one (no ``event_id``)."""
    if not isinstance(document, Mapping) or not document.get("event_id"):
        return None
    return Notice(
        event_id=str(document["event_id"]),
        event_type=str(document.get("event_type") or EVENT_TYPE),
        not_before=str(document.get("not_before", "")),
        description=f"pod {document.get('pod', '?')} is terminating (grace {document.get('grace_s', '?')} s)",
    )


def _notice_dir(url: str | None) -> Path:
    """The directory a ``--notice-url`` names: a path or a ``file://`` URL (``ValueError``)."""
    text = url or DEFAULT_NOTICE_DIR
    if text.startswith("file://"):
        text = text[len("file://") :]
    if "://" in text or not os.path.isabs(text):
        raise ValueError(
            f"pod notices: --notice-url {url!r} is not an absolute directory path "
            "(the emptyDir the pod's preStop hook writes to)"
        )
    return Path(text)


class PodTerminationNotices:
    """The agent's notice source on a kubernetes pod (Note [Pod termination notice]); ``url``: the
    shared directory (None: :data:`DEFAULT_NOTICE_DIR`), ``vm_name``: the pod's name.

    Example::

        source = PodTerminationNotices("/var/run/varuna/notice", "varuna-job-vm3")
        for notice in source.poll():        # [] until the pod is terminating
            ...                             # stop the workers (checkpoint), then:
            source.approve(notice.event_id)  # the preStop hook returns: SIGTERM follows
    """

    def __init__(self, url: str | None, vm_name: str) -> None:
        self.vm_name = vm_name
        self._said: set[str] = set()
        try:
            self.dir: Path | None = _notice_dir(url)
        except ValueError as exc:
            self.dir = None
            self._say(str(exc) + "; this VM will see no termination notice")
            return
        if not self.dir.is_dir():
            self._say(
                f"pod notices: {self.dir} is not a directory (the pod's notice emptyDir is not "
                "mounted there); this VM sees no termination notice until it is"
            )

    def _say(self, line: str) -> None:
        """One line on stderr, once per distinct problem (the agent polls every second)."""
        if line not in self._said:
            self._said.add(line)
            print(line, file=sys.stderr, flush=True)

    def poll(self) -> list[Notice]:
        """The termination notice once the hook wrote it; [] before (or when it cannot be read)."""
        if self.dir is None:
            return []
        path = self.dir / NOTICE_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._say(f"pod notices: cannot read {path}: {exc.strerror or exc}; no notice")
            return []
        try:
            notice = parse_notice(json.loads(text))
        except ValueError:
            notice = None
        if notice is None:
            self._say(f"pod notices: {path} holds no notice ({text[:60]!r}); ignored")
            return []
        return [notice]

    def approve(self, event_id: str) -> bool:
        """Tell the waiting hook the workers are done (it returns; the kubelet then sends SIGTERM)."""
        if self.dir is None:
            return False
        try:
            _write_atomically(self.dir / APPROVED_FILE, event_id)
        except OSError as exc:
            self._say(f"pod notices: cannot approve in {self.dir}: {exc.strerror or exc}")
            return False
        return True


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def pre_stop(directory: str, wait_s: float, pod: str = "", *, clock: Any = time.monotonic) -> bool:
    """The pod's preStop hook: announce the termination in ``directory``, then wait (at most
    ``wait_s``) for the agent's approval. True when approved in time."""
    root = _notice_dir(directory)
    root.mkdir(parents=True, exist_ok=True)
    pod = pod or socket.gethostname()  # a pod's hostname is its name
    now = datetime.now(timezone.utc)
    doc = {
        "event_id": f"{pod}-{int(now.timestamp())}",
        "event_type": EVENT_TYPE,
        "not_before": (now + timedelta(seconds=wait_s)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "grace_s": wait_s,
        "pod": pod,
    }
    if not (root / NOTICE_FILE).exists():  # a repeated hook keeps the first notice
        _write_atomically(root / NOTICE_FILE, json.dumps(doc))
    deadline = clock() + wait_s
    approved = root / APPROVED_FILE
    # A bounded wait on a file the agent writes: the kubelet runs the hook synchronously and sends
    # SIGTERM when it returns, so returning early would cut the workers' checkpoint short.
    while not approved.exists():
        if clock() >= deadline:
            return False
        time.sleep(APPROVAL_POLL_S)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m manager.agent.pod_notices pre-stop --dir DIR --wait S`` (the pod's preStop)."""
    parser = argparse.ArgumentParser(prog="varuna-pod-notices", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    hook = sub.add_parser("pre-stop", help="announce the pod's termination and wait for the agent")
    hook.add_argument("--dir", default=DEFAULT_NOTICE_DIR, help="the notice emptyDir")
    hook.add_argument(
        "--wait",
        type=float,
        required=True,
        metavar="S",
        help="longest wait for the agent's approval (less than the pod's grace period)",
    )
    hook.add_argument("--pod", default="", help="the pod's name (default: the hostname)")
    args = parser.parse_args(argv)
    try:
        approved = pre_stop(args.dir, args.wait, args.pod)
    except (OSError, ValueError) as exc:
        print(f"varuna-pod-notices: error: {exc}", file=sys.stderr)
        return 1  # the kubelet logs a failed hook and goes on with SIGTERM
    outcome = "approved" if approved else "not approved within the wait"
    print(f"varuna-pod-notices: {outcome}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
