"""Live metrics on Ray's metrics pipeline (Prometheus endpoint, dashboard), from the driver.

``RunMetrics`` is an ``EventLog`` listener: it turns each event into ``ray.util.metrics``
updates, so the controller knows nothing of it. The names and their meaning are listed in
``docs/observability.md``. A metric error is logged once and never reaches the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Step times from 10 ms to 10 min: a tiny CPU model up to a large GPU job's step.
STEP_TIME_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0]

GAUGES = {
    "elastic_step": "optimizer steps completed",
    "elastic_step_time_s": "the last step's time, slowest rank (s)",
    "elastic_tokens_per_s": "the last step's throughput (tokens/s)",
    "elastic_rows_per_s": "a TorchTrainer run: the rows its loaders served in the last step per second",
    "elastic_loss": "the last step's loss (mean over the global batch)",
    "elastic_dp": "the data-parallel degree",
    "elastic_data_wait_s": "the last step's wait for its batch, slowest rank (s)",
    "elastic_compute_s": "the last step's forward, backward and optimizer step, slowest rank (s)",
    "elastic_mfu": "the last step's model FLOPs utilisation (0-1), on devices with a known peak",
    "elastic_checkpoint_blocking_s": "the last checkpoint's blocking time per tier (s)",
    "elastic_last_recovery_downtime_s": "the last finished recovery's downtime_s (s, docs/outputs.md)",
}
COUNTERS = {
    "elastic_failures": "failures seen, by cause",
    "elastic_steps_completed": "optimizer steps committed (redone steps count again)",
}
HISTOGRAMS = {"elastic_step_duration_s": "step time distribution (s)"}


class RunMetrics:
    """Export a run's events as Ray metrics tagged with ``run`` (the run directory's name)."""

    def __init__(self, run: str, recoveries: Callable[[], Sequence[Any]] | None = None):
        from ray.util import metrics

        self.run = run
        self.recoveries = recoveries  # the controller's finished recoveries, read when an event arrives
        self._seen_recoveries = 0
        self._failed = False
        keys = ("run",)
        self.g = {name: metrics.Gauge(name, description=d, tag_keys=keys) for name, d in GAUGES.items()}
        self.g["elastic_checkpoint_blocking_s"] = metrics.Gauge(
            "elastic_checkpoint_blocking_s",
            description=GAUGES["elastic_checkpoint_blocking_s"],
            tag_keys=("run", "tier"),
        )
        self.failures = metrics.Counter(
            "elastic_failures", description=COUNTERS["elastic_failures"], tag_keys=("run", "cause")
        )
        self.steps = metrics.Counter(
            "elastic_steps_completed", description=COUNTERS["elastic_steps_completed"], tag_keys=keys
        )
        self.step_hist = metrics.Histogram(
            "elastic_step_duration_s",
            description=HISTOGRAMS["elastic_step_duration_s"],
            boundaries=STEP_TIME_BOUNDARIES,
            tag_keys=keys,
        )
        self.tags = {"run": run}

    def __call__(self, event: dict[str, Any]) -> None:
        if self._failed:
            return
        try:
            self._on(event)
        except Exception:  # never let a metric break training
            self._failed = True
            logger.warning("live metrics disabled after an error", exc_info=True)

    def _set(self, name: str, value: Any) -> None:
        if value is not None:
            self.g[name].set(float(value), tags=self.tags)

    def _on(self, e: dict[str, Any]) -> None:
        kind = e["kind"]
        if kind == "step":
            self._set("elastic_step", e["step"])
            self._set("elastic_step_time_s", e["step_time_s"])
            self._set("elastic_tokens_per_s", e.get("tokens_per_s"))  # a TorchTrainer run has none
            self._set("elastic_rows_per_s", e.get("rows_per_s"))
            self._set("elastic_loss", e.get("loss"))
            self._set("elastic_dp", e["dp"])
            self._set("elastic_data_wait_s", e.get("data_wait_s"))
            self._set("elastic_compute_s", e.get("compute_s"))
            self._set("elastic_mfu", e.get("mfu"))
            self.steps.inc(1.0, tags=self.tags)
            self.step_hist.observe(float(e["step_time_s"]), tags=self.tags)
        elif kind == "job_start":
            self._set("elastic_dp", e["dp"])
        elif kind == "resize":
            self._set("elastic_dp", e["new_dp"])
        elif kind == "failure":
            self.failures.inc(1.0, tags={**self.tags, "cause": str(e.get("cause"))})
        elif kind == "checkpoint":
            self.g["elastic_checkpoint_blocking_s"].set(
                float(e.get("blocking_s") or 0.0), tags={**self.tags, "tier": str(e.get("tier"))}
            )
        self._check_recoveries()

    def _check_recoveries(self) -> None:
        """The controller closes a recovery right after the first step at the new size."""
        if self.recoveries is None:
            return
        recs = self.recoveries()
        if len(recs) > self._seen_recoveries:
            self._seen_recoveries = len(recs)
            self._set("elastic_last_recovery_downtime_s", recs[-1].downtime_s)


def start_metrics(run: str) -> RunMetrics | None:
    """A ``RunMetrics`` on the connected Ray, or None (logged) when metrics cannot be made."""
    try:
        return RunMetrics(run)
    except Exception:
        logger.warning("live metrics unavailable", exc_info=True)
        return None
