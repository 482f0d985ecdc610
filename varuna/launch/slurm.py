"""A Slurm allocation as ``varuna-launch --slurm`` sees it: its nodes (``SLURM_JOB_NODELIST``
expanded, by ``scontrol show hostnames`` when Slurm's commands are here, else by
:func:`expand_hostlist`), the workers each node runs (tasks, or GPUs, per node) and the
rendezvous address, read from the environment of an ``sbatch`` script or an ``salloc`` shell.

Note [Slurm slots]: a node's slots are its tasks (``SLURM_TASKS_PER_NODE``, ``2(x3),1`` = 2, 2, 2,
1), the way torchrun users ask for one task per GPU (``--ntasks-per-node=G --gpus-per-node=G``).
When the job asked for no task count (neither ``SLURM_NTASKS`` nor ``SLURM_NTASKS_PER_NODE``: Slurm
then gives one task per node) and says how many GPUs a node has (``SLURM_GPUS_PER_NODE``,
``[type:]N``, or ``SLURM_GPUS_ON_NODE``), the slots are the GPUs. More tasks than GPUs on a node
would put two workers on one GPU: refused in one line. ``--procs-per-host K`` overrides all of it.

The node list comes from Slurm itself, so a list that does not expand means a broken environment
(a hand-edited variable, a script copied between clusters): one line naming it. ``scontrol`` exits
0 even then and prints part of a name (``n[1-`` gives ``n]``), so its answer is checked against the
grammar (:func:`expand_hostlist`) and every name against the host-name rules of
:mod:`varuna.launch.hosts`.

Example::

    >>> expand_hostlist("gpu-[01-03,7],login1")
    ['gpu-01', 'gpu-02', 'gpu-03', 'gpu-7', 'login1']
    >>> expand_counts("2(x3),1")
    [2, 2, 2, 1]
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from varuna.launch.hosts import HostEntry, parse_host_entry

__all__ = [
    "MAX_NODES",
    "SlurmAllocation",
    "allocation_from_env",
    "expand_counts",
    "expand_hostlist",
    "node_addresses",
    "scontrol_hostnames",
]

#: Largest node list accepted (Slurm's biggest systems have tens of thousands of nodes); a range
#: like ``n[1-999999999]`` is refused before it fills the memory.
MAX_NODES = 100_000
#: How long one ``scontrol`` call may take (slurmctld busy on a large cluster).
SCONTROL_TIMEOUT_S = 30.0

_RANGE_RE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
_COUNT_RE = re.compile(r"^([0-9]+)(?:\(x([0-9]+)\))?$")
_GPUS_RE = re.compile(r"^(?:[A-Za-z0-9_.-]+:)*([0-9]+)$")
_NOT_IN_ALLOCATION = (
    "--slurm needs a Slurm allocation, and SLURM_JOB_ID/SLURM_JOB_NODELIST are not set: run"
    " varuna-launch from an sbatch script or an salloc shell (examples/slurm/), or use --procs/--hosts"
)


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str) -> list[str]:
    """``01-03,7`` → ``['01', '02', '03', '7']`` (zero-padded to the width of the lower bound)."""
    out: list[str] = []
    for item in body.split(","):
        match = _RANGE_RE.match(item)
        if match is None:
            raise ValueError(f"{item!r} is not a number or a range lo-hi")
        lo_text, hi_text = match.group(1), match.group(2)
        lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
        if hi < lo:
            raise ValueError(f"range {item!r} runs backwards")
        if len(out) + hi - lo + 1 > MAX_NODES:
            raise ValueError(f"more than {MAX_NODES} names")
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_expr(expr: str) -> list[str]:
    """One host expression: literal parts and bracket groups, their product (``r[1-2]n[1-2]``)."""
    pieces: list[list[str]] = []
    for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", expr):
        if literal:
            pieces.append([literal])
        if body:
            pieces.append(_expand_ranges(body))
        elif "[]" in expr:
            raise ValueError("empty '[]'")
    if not pieces:
        raise ValueError("empty name")
    names = ["".join(p) for p in itertools.product(*pieces)]
    if len(names) > MAX_NODES:
        raise ValueError(f"more than {MAX_NODES} names")
    return names


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list (``n[1-3,5],gpu-[01-02]``) as ``scontrol show hostnames`` does:
    comma-separated expressions, each a name with bracketed groups of numbers and ranges, zero
    padding kept, several groups multiplied (``rack[1-2]-n[1-2]``). ``ValueError`` (one line) when
    the text is not a host list.

    Example::

        >>> expand_hostlist("rack[1-2]-n[1-2]")
        ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
        >>> expand_hostlist("n[3-1]")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: 'n[3-1]' is not a Slurm host list: range '3-1' runs backwards
    """
    try:
        if not text.strip() or any(c.isspace() for c in text):
            raise ValueError("empty, or with blanks" if text.strip() else "empty")
        names: list[str] = []
        for expr in _split_top(text):
            names.extend(_expand_expr(expr))
            if len(names) > MAX_NODES:
                raise ValueError(f"more than {MAX_NODES} names")
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a Slurm host list: {exc}") from None
    return names


def expand_counts(text: str, *, what: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's per-node counts (``2(x3),1`` → ``[2, 2, 2, 1]``); ``ValueError`` names ``what``.

    Example::

        >>> expand_counts("4")
        [4]
    """
    out: list[int] = []
    for item in text.split(","):
        match = _COUNT_RE.match(item.strip())
        if match is None:
            raise ValueError(f"{what}={text!r} is not a list of counts like 2(x3),1")
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
        if len(out) > MAX_NODES:
            raise ValueError(f"{what}={text!r} counts more than {MAX_NODES} nodes")
    return out


def scontrol_hostnames(nodelist: str, *, scontrol: str = "scontrol") -> list[str]:
    """``scontrol show hostnames NODELIST``, checked (``ValueError``, one line): scontrol exits 0
    and prints part of a name for some lists it cannot read (Note [Slurm slots])."""
    try:
        result = subprocess.run(
            [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
            timeout=SCONTROL_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(f"scontrol show hostnames did not answer within {SCONTROL_TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise ValueError(f"cannot run {scontrol}: {exc.strerror or exc}") from None
    names = result.stdout.split()
    said = result.stderr.strip().splitlines()
    complained = any("invalid" in s.lower() or "error" in s.lower() for s in said)
    if result.returncode != 0 or not names or complained:
        why = said[-1] if said else f"exit code {result.returncode}, no names"
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} is a node list Slurm cannot expand ({why})")
    return names


def node_addresses(nodes: Sequence[str], nodelist: str, *, scontrol: str = "scontrol") -> dict[str, str]:
    """Each node's ``NodeAddr`` (``scontrol show node -o NODELIST``, one call), for the nodes whose
    address is not their name; empty when scontrol cannot say (the names are then used)."""
    try:
        result = subprocess.run(
            [scontrol, "show", "node", "-o", nodelist], capture_output=True, text=True,
            timeout=SCONTROL_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    addresses = {}
    for line in result.stdout.splitlines():
        fields = dict(t.split("=", 1) for t in line.split() if "=" in t)
        name, addr = fields.get("NodeName"), fields.get("NodeAddr")
        if name in nodes and addr and addr != name:
            addresses[name] = addr
    return addresses


@dataclass(frozen=True, kw_only=True)
class SlurmAllocation:
    """The nodes of the allocation this process runs in, with their slots (Note [Slurm slots]).

    Example::

        >>> a = allocation_from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
        ...                          "SLURM_TASKS_PER_NODE": "2(x2)"}, scontrol=None)
        >>> [(e.host, e.slots) for e in a.entries()]
        [('n1', 2), ('n2', 2)]
    """

    job_id: str
    """``SLURM_JOB_ID``."""
    nodes: tuple[str, ...]
    """The allocation's nodes, in Slurm's order."""
    slots: tuple[int, ...]
    """Workers each node runs."""
    cpus: tuple[int | None, ...]
    """CPUs of each node in the allocation (``SLURM_JOB_CPUS_PER_NODE``), None when not said."""
    addresses: Mapping[str, str]
    """``NodeAddr`` of the nodes whose address is not their name."""
    restart_count: int = 0
    """``SLURM_RESTART_COUNT``: how often the job was requeued."""
    slots_from: str = "SLURM_TASKS_PER_NODE"
    """Where the slot counts came from, for messages."""

    def entries(self) -> list[HostEntry]:
        """One host entry per node (validated host names), its slots and its address."""
        out = []
        for index, (node, slots) in enumerate(zip(self.nodes, self.slots)):
            origin = f"SLURM_JOB_NODELIST node {index + 1}"
            try:
                entry = parse_host_entry(node, origin=origin)
            except ValueError as exc:
                raise ValueError(f"{exc} (a Slurm node name varuna cannot use)") from None
            out.append(HostEntry(host=entry.host, slots=slots, origin=origin, addr=self.addresses.get(node)))
        return out

    def describe(self) -> str:
        """``2 node(s) n[1-2] × 2 tasks``, for messages."""
        counts = sorted(set(self.slots))
        per = f"{counts[0]}" if len(counts) == 1 else "/".join(map(str, self.slots))
        return f"{len(self.nodes)} node(s) × {per} slot(s) from {self.slots_from}, {sum(self.slots)} in all"


def _gpus_per_node(environ: Mapping[str, str]) -> int | None:
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        text = environ.get(name, "").strip()
        if text:
            match = _GPUS_RE.match(text)
            if match is None:
                raise ValueError(f"{name}={text!r} is not a GPU count ([type:]N)")
            return int(match.group(1))
    return None


def _slots(environ: Mapping[str, str], count: int) -> tuple[list[int], str]:
    """Slots per node and where they came from (Note [Slurm slots])."""
    tasks_text = environ.get("SLURM_TASKS_PER_NODE") or environ.get("SLURM_STEP_TASKS_PER_NODE") or ""
    tasks = expand_counts(tasks_text) if tasks_text else [1] * count
    if len(tasks) != count:
        raise ValueError(
            f"SLURM_TASKS_PER_NODE={tasks_text!r} counts {len(tasks)} node(s) but SLURM_JOB_NODELIST names"
            f" {count}; the environment is not one allocation's (unset the stale SLURM_* variables)"
        )
    gpus = _gpus_per_node(environ)
    asked_tasks = bool(environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_NTASKS"))
    if gpus is not None and not asked_tasks and gpus > 0:
        return [gpus] * count, "GPUs per node"
    if gpus is not None and gpus > 0 and max(tasks) > gpus:
        raise ValueError(
            f"the allocation has {max(tasks)} tasks on a node but {gpus} GPU(s) per node: two workers would"
            f" share a GPU; ask for --ntasks-per-node={gpus} (one task per GPU) or give --procs-per-host"
        )
    return tasks, "tasks per node" if tasks_text else "one task per node"


def allocation_from_env(
    environ: Mapping[str, str], *, scontrol: str | None = "scontrol"
) -> SlurmAllocation:
    """The allocation described by ``environ`` (an sbatch script's or salloc shell's environment).

    ``scontrol``: the command that expands the node list (None, or not on ``PATH``: the pure
    :func:`expand_hostlist`, also used to check scontrol's answer). ``ValueError`` (one line) when
    not inside an allocation, when the node list does not expand, or when the counts disagree.
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or nodelist is None:
        raise ValueError(_NOT_IN_ALLOCATION)
    step_tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
    if environ.get("SLURM_STEP_ID") is not None and step_tasks.isdigit() and int(step_tasks) > 1:
        task, step = environ.get("SLURM_PROCID", "?"), environ.get("SLURM_STEP_ID")
        raise ValueError(
            f"varuna-launch --slurm is running as task {task} of {step_tasks} of job step {step}: it starts"
            " one agent per node itself, so run it once, in the batch script (or salloc shell), not under"
            " srun"
        )
    try:
        expected = expand_hostlist(nodelist)
    except ValueError as exc:
        raise ValueError(f"SLURM_JOB_NODELIST: {exc}; the environment is not a Slurm allocation's") from None
    addresses: dict[str, str] = {}
    if scontrol is not None and shutil.which(scontrol) is not None:
        nodes = scontrol_hostnames(nodelist, scontrol=scontrol)
        if nodes != expected:
            raise ValueError(
                f"SLURM_JOB_NODELIST={nodelist!r}: scontrol expands it to {len(nodes)} name(s)"
                f" ({nodes[0]}...), not the {len(expected)} the host-list grammar gives ({expected[0]}...);"
                " check the variable"
            )
        addresses = node_addresses(nodes, nodelist, scontrol=scontrol)
    else:
        nodes = expected
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names a node twice")
    slots, slots_from = _slots(environ, len(nodes))
    cpus_text = environ.get("SLURM_JOB_CPUS_PER_NODE", "")
    cpus: list[int | None] = [None] * len(nodes)
    if cpus_text:
        counted = expand_counts(cpus_text, what="SLURM_JOB_CPUS_PER_NODE")
        if len(counted) == len(nodes):
            cpus = list(counted)
    restarts = environ.get("SLURM_RESTART_COUNT", "0")
    return SlurmAllocation(
        job_id=job_id,
        nodes=tuple(nodes),
        slots=tuple(slots),
        cpus=tuple(cpus),
        addresses=addresses,
        restart_count=int(restarts) if restarts.isdigit() else 0,
        slots_from=slots_from,
    )
