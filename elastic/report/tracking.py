"""Experiment tracking from the event stream, in the driver: the scalars every tracker logs,
and the TensorBoard writer behind ``train.tensorboard``.

``EventScalars`` turns each ``events.jsonl`` event (docs/outputs.md) into the step it
belongs to and the scalars to log there; ``TensorBoardWriter`` (an ``EventLog`` listener,
like ``metrics.RunMetrics``) writes them with tensorboardX, which Ray Tune already
installs. The W&B and MLflow callbacks (``trackers.py``) log the same scalars. The names
and their meaning: docs/observability.md. A tracker's error is logged once and disables
that tracker; it never reaches the run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# step event field -> scalar name
STEP_SCALARS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "mfu": "perf/mfu",
    "data_wait_s": "perf/data_wait_s",
    "compute_s": "perf/compute_s",
    "peak_mem_bytes": "perf/peak_mem_bytes",
    "dp": "elastic/dp",
    "grad_accum": "elastic/grad_accum",
}


class EventScalars:
    """(step, {name: value}) for each event, or None for an event with nothing to log.

    Events without a step of their own (failures, resizes) are logged at the last step
    committed. ``elastic/failures`` and ``elastic/recoveries`` count, and
    ``elastic/step_gap_s`` is the time from the last step before a failure or resize to
    the first one after it (as ``elastic report`` measures it), logged at that step.
    """

    def __init__(self) -> None:
        self.step = 0
        self.failures = 0
        self.recoveries = 0
        self._last_step_ts: float | None = None
        self._gap_from: float | None = None  # the last step's ts before an outage

    def __call__(self, event: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
        kind = event["kind"]
        if kind == "step":
            return self._step(event)
        if kind in ("failure", "resize"):
            if self._gap_from is None:
                self._gap_from = self._last_step_ts if self._last_step_ts is not None else event["ts"]
            if kind == "resize":
                return self.step, {"elastic/dp": float(event["new_dp"])}
            self.failures += 1
            return self.step, {"elastic/failures": float(self.failures)}
        if kind == "restore":
            return int(event["step"]), {"elastic/restore_s": float(event["duration_s"])}
        if kind == "checkpoint":
            return int(event["step"]), {f"checkpoint/{event['tier']}_blocking_s": float(event["blocking_s"])}
        if kind == "eval":
            return int(event["step"]), {"eval/loss": float(event["eval_loss"])}
        if kind == "job_start":
            return 0, {"elastic/dp": float(event["dp"])}
        return None

    def _step(self, e: dict[str, Any]) -> tuple[int, dict[str, float]]:
        self.step = int(e["step"])
        values = {name: float(e[key]) for key, name in STEP_SCALARS.items() if e.get(key) is not None}
        for key, value in (e.get("metrics") or {}).items():  # a TorchTrainer loop's own report
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[f"report/{key}"] = float(value)
        if self._gap_from is not None:
            self.recoveries += 1
            values["elastic/recoveries"] = float(self.recoveries)
            values["elastic/step_gap_s"] = e["ts"] - self._gap_from
            self._gap_from = None
        self._last_step_ts = e["ts"]
        return self.step, values


class SafeSink:
    """Calls ``log(step, values, ts)`` for each event's scalars; the first error disables it."""

    def __init__(self, name: str, log: Callable[[int, dict[str, float], float], None]):
        self.name, self.log = name, log
        self.scalars = EventScalars()
        self.failed = False

    def __call__(self, event: dict[str, Any]) -> None:
        if self.failed:
            return
        try:
            record = self.scalars(event)
            if record is not None and record[1]:
                self.log(record[0], record[1], float(event["ts"]))
        except Exception:  # never let a tracker break training
            self.failed = True
            logger.warning("%s disabled after an error", self.name, exc_info=True)


def tensorboard_dir(setting: bool | str, run_dir: str) -> str | None:
    """Where ``train.tensorboard`` writes: ``true`` is ``RUN_DIR/tensorboard``, a string a
    directory of its own; ``false`` none."""
    if setting is False:
        return None
    return os.path.join(run_dir, "tensorboard") if setting is True else str(setting)


class TensorBoardWriter:
    """An ``EventLog`` listener writing the run's scalars as TensorBoard event files."""

    def __init__(self, log_dir: str):
        from tensorboardX import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(logdir=log_dir, flush_secs=10)
        self.sink = SafeSink("tensorboard", self._log)

    def __call__(self, event: dict[str, Any]) -> None:
        self.sink(event)
        if event["kind"] == "job_end":
            self.writer.flush()

    def _log(self, step: int, values: dict[str, float], ts: float) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step, walltime=ts)

    def close(self) -> None:
        self.writer.close()


def start_tensorboard(setting: bool | str, run_dir: str) -> TensorBoardWriter | None:
    """The writer ``train.tensorboard`` asks for, or None (off, or it could not start: logged)."""
    log_dir = tensorboard_dir(setting, run_dir)
    if log_dir is None:
        return None
    try:
        return TensorBoardWriter(log_dir)
    except Exception:
        logger.warning("train.tensorboard: the writer could not start", exc_info=True)
        return None
