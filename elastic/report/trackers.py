"""Weights & Biases and MLflow as job callbacks, in the driver (optional packages).

Pass one to ``ElasticTrainer(spec, callbacks=[...])``; it logs the scalars of
``tracking.EventScalars`` (docs/observability.md) as the events arrive (``after_event``)
and ends its run in ``close``. The package is imported when the callback is made, so a
missing one fails there, with how to install it, before the job starts. An error while
logging is logged once and disables the callback; it never reaches the run.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from elastic.control.callbacks import Callback
from elastic.report.tracking import SafeSink


def _require(module: str, pip_name: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{module} is not installed: pip install {pip_name}") from exc


class WandbCallback(Callback):
    """Logs the run to Weights & Biases (``pip install wandb``; ``wandb login`` or
    ``WANDB_API_KEY``, or ``mode="offline"``).

    ``init`` keywords go to ``wandb.init`` (``project``, ``name``, ``entity``, ``mode``,
    ...); ``config`` (e.g. ``spec.model_dump()``) is recorded with the run. Every scalar is
    logged against the ``step`` metric: W&B's own step must only grow, and a recovery can
    redo steps.
    """

    def __init__(self, config: dict[str, Any] | None = None, **init: Any):
        self.wandb = _require("wandb", "wandb")
        self.config, self.init = config or {}, init
        self.run: Any = None
        self.sink = SafeSink("wandb", self._log)

    def after_event(self, event: dict[str, Any]) -> None:
        if event["kind"] == "job_start" and self.run is None:
            self.run = self.wandb.init(config={**self.config, "layout": _layout(event)}, **self.init)
            self.run.define_metric("*", step_metric="step")
        if self.run is not None:
            self.sink(event)

    def _log(self, step: int, values: dict[str, float], ts: float) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MlflowCallback(Callback):
    """Logs the run to MLflow (``pip install mlflow`` or ``mlflow-skinny``).

    ``tracking_uri``: the server or store (default: MLflow's own, ``MLFLOW_TRACKING_URI``);
    ``experiment``: its name (created if missing); ``params``: recorded with the run
    beside the layout at the start (dp, tp, pp, nodes). The run ends ``FINISHED`` or
    ``FAILED`` with the job.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "elastic",
        run_name: str | None = None,
        params: dict[str, Any] | None = None,
    ):
        mlflow = _require("mlflow", "mlflow")
        self.entities = importlib.import_module("mlflow.entities")
        self.client = mlflow.tracking.MlflowClient(tracking_uri)
        self.experiment, self.run_name, self.params = experiment, run_name, params or {}
        self.run_id: str | None = None
        self.status = "FAILED"  # until a job_end says otherwise
        self.sink = SafeSink("mlflow", self._log)

    def after_event(self, event: dict[str, Any]) -> None:
        if event["kind"] == "job_start" and self.run_id is None:
            self._start(event)
        elif event["kind"] == "job_end":
            self.status = "FINISHED" if event.get("status") == "succeeded" else "FAILED"
        if self.run_id is not None:
            self.sink(event)

    def _start(self, event: dict[str, Any]) -> None:
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        params = {**_layout(event), **self.params}
        self.client.log_batch(self.run_id, params=[self.entities.Param(k, str(v)) for k, v in params.items()])

    def _log(self, step: int, values: dict[str, float], ts: float) -> None:
        ms = int(ts * 1000)
        metrics = [self.entities.Metric(k, v, ms, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=self.status, end_time=int(time.time() * 1000))
            self.run_id = None


def _layout(job_start: dict[str, Any]) -> dict[str, Any]:
    return {k: job_start[k] for k in ("dp", "tp", "pp", "nodes") if k in job_start}
