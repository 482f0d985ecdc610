"""Slurm's ``srun`` as a remote-start method (Note [Remote start] in :mod:`varuna.launch.remote`):
one job step per node, each running one agent, inside the allocation ``varuna-launch --slurm``
runs in; and ``scontrol requeue``, which puts a job stopped by Slurm's signal back in the queue.

Note [Agents as job steps]: each agent is ``srun --overlap --nodes=1 --ntasks=1 --nodelist=NODE``
with every CPU and all the memory the job holds on that node (``--cpus-per-task``, ``--mem=0``), so
that its workers — the agent's children, in the step — are not squeezed onto one CPU where the
cluster confines steps (task/affinity, task/cgroup); ``--overlap`` lets the step share the node with
the batch step and with any step the user runs beside it. The step's task is the agent; its stdin
and stdout, relayed by srun, are the agent's channel to the launcher exactly as over ssh. srun
exports the launcher's environment to the task (``--export=ALL``). Slurm tracks the step's
processes (proctrack), so a step that ends, or a job that ends, takes every worker with it.

Slurm signals the processes of a step itself — ``scancel --signal=USR1``, ``sbatch
--signal=USR1@T`` before the time limit, SIGTERM at a preemption — which reach the agent, its
workers and the srun client. The agent then reports the signal to the launcher
(``--report-signals``) instead of stopping its workers, and the launcher turns it into the one
graceful stop of the whole job (Note [Slurm stop] in :mod:`varuna.launch.launcher`).

Example::

    >>> from varuna.launch.hosts import HostEntry
    >>> argv = SrunOptions().agent_argv(HostEntry(host="n1", slots=2), python="/usr/bin/python3",
    ...                                 pythonpath=[], agent_args=["--job-id", "j"])
    >>> argv[:2], "--nodelist=n1" in argv, argv[-5:]
    (['srun', '--overlap'], True, ['/usr/bin/python3', '-m', 'varuna.launch.agent', '--job-id', 'j'])
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from varuna.launch.hosts import HostEntry
from varuna.launch.remote import agent_environ

__all__ = ["SrunOptions", "requeue"]

#: How long ``scontrol requeue`` may take.
REQUEUE_TIMEOUT_S = 30.0
#: srun reads these from its environment as options (sbatch exports the job's shape in them); an
#: agent's step is one task that gets the whole node, so the job's per-task shape must not apply
#: to it (``--gpus-per-task=1`` would leave every worker of the node one GPU). Without them srun
#: gives the step all of the job's GPUs (GRES) on the node and, with ``--mem=0``, all its memory.
STEP_SHAPE_VARS = frozenset({
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK", "SLURM_GPUS_PER_TASK",
    "SLURM_TRES_PER_TASK", "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU",
    "SLURM_MEM_PER_NODE", "SLURM_DISTRIBUTION", "SLURM_CPU_BIND",
})  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class SrunOptions:
    """How to start agents as job steps of the current allocation (Note [Agents as job steps]).

    Example::

        >>> SrunOptions(cpus={"n1": 8}).agent_argv(HostEntry(host="n1", slots=1), python="/p",
        ...     pythonpath=[], agent_args=[])[6]
        '--cpus-per-task=8'
    """

    srun: str = "srun"
    """The srun client."""
    cpus: Mapping[str, int] = field(default_factory=dict)
    """CPUs the job holds on each node (``SLURM_JOB_CPUS_PER_NODE``); a node not listed: srun's default."""
    method: ClassVar[str] = "srun"
    reports_signals: ClassVar[bool] = True

    def agent_argv(
        self, entry: HostEntry, *, python: str, pythonpath: Sequence[str], agent_args: Sequence[str]
    ) -> list[str]:
        """``srun --overlap ... --nodelist=NODE python -m varuna.launch.agent ARGS``."""
        argv = [
            self.srun,
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            "--ntasks-per-node=1",  # the batch environment's SLURM_NTASKS_PER_NODE would apply otherwise
            f"--nodelist={entry.host}",
        ]
        if entry.host in self.cpus:
            argv.append(f"--cpus-per-task={self.cpus[entry.host]}")
        argv += ["--mem=0", "--export=ALL", "--job-name=varuna-agent", python, "-m", "varuna.launch.agent",
                 *agent_args]
        return argv

    def agent_env(self, environ: Mapping[str, str], pythonpath: Sequence[str]) -> dict[str, str] | None:
        """The launcher's environment with ``PYTHONPATH`` (srun exports it to the agent), without
        the job's per-task shape (:data:`STEP_SHAPE_VARS`)."""
        env = agent_environ(environ, pythonpath)
        for name in STEP_SHAPE_VARS:
            env.pop(name, None)
        return env


def requeue(job_id: str, *, scontrol: str = "scontrol") -> str | None:
    """``scontrol requeue JOB_ID``: None when Slurm took it, else why not (one line: a job
    submitted with ``--no-requeue``, an interactive allocation, a job already ending).

    Slurm ends what still runs of the job (this launcher included) and queues it again; the new
    run starts the batch script from the top, which resumes from the newest checkpoint."""
    try:
        result = subprocess.run(
            [scontrol, "requeue", job_id], capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"scontrol requeue did not answer within {REQUEUE_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"cannot run {scontrol}: {exc.strerror or exc}"
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        return lines[-1] if lines else f"scontrol exited with code {result.returncode}"
    return None
