"""TensorBoard output of the per-step metrics (``VarunaConfig.metrics.tensorboard_dir``), beside JSON Lines.

One rank (rank 0: it holds the agreed loss and global gradient norm, like every rank, and is the
one that writes the example's JSON Lines) writes, through ``torch.utils.tensorboard``:

- scalars, at ``global_step`` = the step and with the step's own ``wall_time``: ``train/loss``
  (mean over the whole mini-batch), ``train/grad_norm`` (global, before clipping; inf on a
  skipped step), ``train/samples_per_s``, ``train/step_s``, ``train/tflops`` and
  ``train/hardware_tflops`` (per device) and ``train/mfu`` (when known), ``layout/P``, ``layout/D``,
  ``train/loss_scale`` (fp16 only) and ``eval/loss`` (each ``Engine.evaluate``);
- text events: ``varuna/layout`` when the run starts (P×D, m, schedule, stage ranges),
  ``varuna/resume`` when it resumed from a checkpoint, ``varuna/morph`` when that checkpoint was
  written at another P×D (the manager morphs a job exactly so: graceful stop, checkpoint,
  relaunch at the new layout with resume).

Note [Restarts in the event stream]: every run appends a new event file to the directory and
opens it with a purge mark at its first step (``SummaryWriter(purge_step=step_count + 1)``):
TensorBoard's reader then drops the events an earlier run wrote for that step and later ones
(steps it ran after the checkpoint it left behind), so a resumed run continues each series
without duplicates. A fresh run in a used directory therefore hides that directory's older series.

Durability: the writer is flushed after every step (a queue drain and a file flush, no fsync), so
a ``kill -9`` loses at most the events of the step in flight; a machine crash can lose what the
OS had not written yet. ``close`` (called by ``Engine.close``, also at exit) flushes and joins the
writer's thread.

Example::

    VARUNA_TENSORBOARD_DIR=runs/tb varuna-launch --procs 2 --pipeline-depth 2 train.py
    tensorboard --logdir runs/tb
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from varuna.core.env import WorkerSettings
from varuna.core.extras import require
from varuna.runtime.checkpoint import Resumed
from varuna.runtime.config import StepResult, VarunaConfig

__all__ = [
    "TENSORBOARD_VAR",
    "INSTALL_HINT",
    "TensorBoardLog",
    "adopt_tensorboard_env",
    "adopt_tensorboard_settings",
    "require_tensorboard",
    "summary_writer_class",
]

#: The environment variable ``varuna-launch --tensorboard-dir`` exports to every worker.
TENSORBOARD_VAR = "VARUNA_TENSORBOARD_DIR"
INSTALL_HINT = "pip install 'varuna[tensorboard]'"


def adopt_tensorboard_env(config: VarunaConfig, environ: Mapping[str, str] | None = None) -> None:
    """Fill ``config.metrics.tensorboard_dir`` from ``$VARUNA_TENSORBOARD_DIR`` where the script
    left it unset (read through ``varuna.core.env.WorkerSettings``).

    Example::

        >>> cfg = VarunaConfig(global_batch_size=8, micro_batch_size=2)
        >>> adopt_tensorboard_env(cfg, {"VARUNA_TENSORBOARD_DIR": "runs/tb"})
        >>> cfg.metrics.tensorboard_dir
        'runs/tb'
    """
    adopt_tensorboard_settings(config, WorkerSettings.from_env(environ))


def adopt_tensorboard_settings(config: VarunaConfig, settings: WorkerSettings) -> None:
    """:func:`adopt_tensorboard_env` from parsed settings."""
    if settings.tensorboard_dir and config.metrics.tensorboard_dir is None:
        config.metrics = dataclasses.replace(config.metrics, tensorboard_dir=settings.tensorboard_dir)


def summary_writer_class() -> type:
    """``torch.utils.tensorboard.SummaryWriter``, or ``ImportError`` (one line naming the extra)."""
    # torch.utils.tensorboard imports the package at its top; checking it first gives the hint.
    require("tensorboard", "tensorboard", "tensorboard_dir")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def require_tensorboard(config: VarunaConfig) -> None:
    """``ImportError`` (one line) when ``config.metrics.tensorboard_dir`` is set but the package is missing.

    Every rank calls it before the process group exists, so a missing package stops all ranks
    at once instead of leaving the others waiting for rank 0.

    Example::

        >>> require_tensorboard(VarunaConfig(global_batch_size=8, micro_batch_size=2))  # off: no check
    """
    if config.metrics.tensorboard_dir is not None:
        summary_writer_class()


class TensorBoardLog:
    """The TensorBoard event writer of one run, on the rank that logs.

    ``start_step``: the steps done before this run (0, or the checkpoint's step); ``info``: the
    engine's ``describe()``; ``resumed``: the checkpoint it resumed from, if any.

    Example::

        log = TensorBoardLog("runs/tb", info=engine.describe(), start_step=engine.step_count)
        engine.add_step_callback(log.on_step)
        ...
        log.close()
    """

    def __init__(
        self, directory: str, *, info: Mapping[str, Any], start_step: int = 0, resumed: Resumed | None = None
    ) -> None:
        writer_cls = summary_writer_class()
        try:  # Note [Restarts in the event stream]
            self._writer = writer_cls(log_dir=directory, purge_step=start_step + 1)
        except OSError as e:
            raise ValueError(
                f"tensorboard_dir {directory!r}: cannot write event files there ({e.strerror or e}); "
                "pick a writable directory (--tensorboard-dir / VARUNA_TENSORBOARD_DIR)"
            ) from None
        self.directory = directory
        self.P, self.D = int(info["P"]), int(info["D"])
        self._fp16 = info.get("precision") == "fp16"
        first = start_step + 1
        self._writer.add_text(
            "varuna/layout",
            f"P×D {self.P}×{self.D}, m {info['m']}, Nm {info['Nm']}, schedule {info['schedule']}, "
            f"stage ranges {info['stage_ranges']}, from step {first}",
            global_step=first,
        )
        if resumed is not None:
            was = f"{resumed.P}×{resumed.D}" if resumed.P is not None else "an unrecorded layout"
            self._writer.add_text(
                "varuna/resume",
                f"resumed from {resumed.path} (after step {resumed.step}, written at P×D {was})",
                global_step=first,
            )
            if (resumed.P, resumed.D) != (self.P, self.D) and resumed.P is not None:
                self._writer.add_text(
                    "varuna/morph", f"P×D {was} → {self.P}×{self.D} at step {first}", global_step=first
                )
        self._writer.flush()

    @classmethod
    def attach(cls, engine: Any) -> TensorBoardLog | None:
        """On rank 0 of ``engine`` (an :class:`~varuna.runtime.engine.Engine`) whose config names
        a ``metrics.tensorboard_dir``: the log, registered as a step callback; else None. Call it
        after the engine resumed (it notes the resume and any morph); close it with the engine."""
        directory = engine.config.metrics.tensorboard_dir
        if directory is None or engine.layout.rank != 0:
            return None
        log = cls(directory, info=engine.describe(), start_step=engine.step_count,
                  resumed=engine.checkpointer.resumed)
        engine.add_step_callback(log.on_step)
        return log

    def on_step(self, r: StepResult) -> None:
        """Write one step's scalars and flush (a step callback)."""
        w, step, t = self._writer, r.step, r.wall_time
        w.add_scalar("train/loss", r.loss, step, walltime=t)
        w.add_scalar("train/grad_norm", r.grad_norm, step, walltime=t)
        w.add_scalar("train/samples_per_s", r.samples_per_s, step, walltime=t)
        w.add_scalar("train/step_s", r.step_s, step, walltime=t)
        for tag, value in (("train/tflops", r.tflops), ("train/hardware_tflops", r.hardware_tflops),
                           ("train/mfu", r.mfu)):
            if value is not None:  # not counted, or no known peak (CPU): no point rather than a 0
                w.add_scalar(tag, value, step, walltime=t)
        w.add_scalar("layout/P", self.P, step, walltime=t)
        w.add_scalar("layout/D", self.D, step, walltime=t)
        if self._fp16:
            w.add_scalar("train/loss_scale", r.loss_scale, step, walltime=t)
        w.flush()

    def on_eval(self, step: int, loss: float) -> None:
        """Write an evaluation loss at ``step`` (the steps trained so far)."""
        self._writer.add_scalar("eval/loss", loss, step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file and join the writer's thread (idempotent)."""
        self._writer.close()
