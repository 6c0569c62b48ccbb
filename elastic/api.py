"""The Python API: ``ElasticTrainer(spec).fit() -> RunResult``."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import ray

from elastic.control.callbacks import Callback, checked
from elastic.control.controller import Controller
from elastic.control.stop import StopSignals
from elastic.errors import JobFailed
from elastic.events import EventLog, RunResult, write_summary
from elastic.ingest.corpus import synthetic_corpus
from elastic.progress import ProgressDisplay, format_summary
from elastic.report.metrics import start_metrics
from elastic.report.print_report import print_report
from elastic.report.tracking import start_tensorboard
from elastic.worker.hooks import StepHook

if TYPE_CHECKING:
    from elastic.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["ElasticTrainer", "RunResult"]


class ElasticTrainer:
    """Runs one elastic training job described by a ``jobs.JobSpec``."""

    controller_cls = Controller

    def __init__(
        self,
        spec: JobSpec,
        *,
        run_dir: str | None = None,
        address: str | None = None,
        resume: bool = False,
        callbacks: list[Callback] | None = None,
        step_hook: StepHook | None = None,
        progress: bool = False,
        report: bool = False,
    ):
        self.spec = spec
        self.run_dir = os.path.abspath(run_dir or spec.run_dir or _default_run_dir(spec.name))
        self.address = address
        self.resume = resume
        self.callbacks = checked(callbacks or [])  # a TypeError now, not a silently ignored hook
        self.step_hook = step_hook  # acts inside every worker step (fault injection: docs/faults.md)
        self.progress = progress
        self.report = report  # write RUN_DIR/report at the end and print its path (docs/observability.md)
        self.result: RunResult | None = None

    @property
    def checkpoint_uri(self) -> str:
        return self.spec.checkpoint.uri or os.path.join(self.run_dir, "checkpoints")

    def fit(self) -> RunResult:
        os.makedirs(self.run_dir, exist_ok=True)
        started_ray = ensure_ray(self.address, self.spec)
        events = EventLog(self.run_dir)
        if self.progress:
            events.subscribe(ProgressDisplay(self.spec.train.steps))
        metrics = start_metrics(os.path.basename(self.run_dir))  # live Ray metrics (docs/observability.md)
        if metrics is not None:
            events.subscribe(metrics)
        tensorboard = start_tensorboard(self.spec.train.tensorboard, self.run_dir)  # train.tensorboard
        if tensorboard is not None:
            events.subscribe(tensorboard)
        for cb in self.callbacks:
            events.subscribe(cb.after_event)
        signals = StopSignals(self.spec.elastic.stop_grace_s)  # after ray.init, which installs its own
        signals.install()
        try:
            corpus = self._prepare_data()
            resume = self._resume_point() if self.resume else None
            controller = self.controller_cls(
                self.spec,
                events,
                corpus,
                callbacks=self.callbacks,
                step_hook=self.step_hook,
                resume=resume,
                storage_uri=self.checkpoint_uri,
                stop_signals=signals,
            )
            if metrics is not None:
                metrics.recoveries = lambda: controller.recoveries
            try:
                self.result = controller.run()
            except JobFailed as exc:
                self.result = getattr(exc, "result", None)
                raise
            finally:
                if self.result is not None:
                    write_summary(self.run_dir, self.result)
                    if self.progress:
                        out = sys.stderr if self.result.status != "succeeded" else sys.stdout
                        print(format_summary(self.result, self.run_dir), file=out)
        finally:
            signals.uninstall()
            events.close()
            if tensorboard is not None:
                tensorboard.close()
            for cb in self.callbacks:
                cb.close()
            if started_ray:
                ray.shutdown()
            if self.report:
                print_report(self.run_dir)
        return self.result

    def _prepare_data(self) -> str:
        d = self.spec.data
        if d.source != "synthetic":
            return d.source
        cache = d.cache_dir or os.path.join(self.run_dir, "data")
        m = self.spec.model
        return synthetic_corpus(cache, d.num_samples, m.seq_len, m.vocab_size, self.spec.seed)

    def _resume_point(self) -> int | None:
        from elastic.checkpoint.restore import latest_storage_step

        step = latest_storage_step(self.spec, self.checkpoint_uri)
        if step is None:
            logger.warning("--resume: no valid checkpoint under %s; starting from step 0", self.checkpoint_uri)
        return step


def ensure_ray(address: str | None, spec: Any) -> bool:
    """Connect to Ray; returns True when this call started an embedded local instance.

    With ``address`` it joins that cluster. Without, it joins a running cluster if one is
    reachable (``RAY_ADDRESS`` or a local head), and otherwise starts an embedded Ray
    sized to the job: enough logical CPUs for ``max_dp`` replicas even on a 2-core laptop.
    """
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address:
        ray.init(address=address, **quiet)
        return False
    running = running_cluster_address()
    if running:
        ray.init(address=running, **quiet)
        return False
    workers = spec.elastic.max_dp * spec.parallel.replica_size
    cpus = max(os.cpu_count() or 1, workers * max(spec.resources.cpus_per_worker, 1) + 1)
    resources = {k: v * workers for k, v in spec.resources.custom.items()}
    ray.init(address="local", num_cpus=int(cpus), resources=resources or None, include_dashboard=False, **quiet)
    return True


def _default_run_dir(name: str) -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return os.path.join("runs", f"{name}-{stamp}")


def running_cluster_address(probe_timeout_s: float = 0.5) -> str | None:
    """The address of a reachable running Ray cluster, or None.

    ``RAY_ADDRESS`` wins; otherwise the head recorded by the last ``ray start`` on this
    machine, but only if its GCS accepts a connection: a stale record of a dead cluster
    would make ``ray.init(address="auto")`` wait for minutes.
    """
    import socket
    import tempfile

    address = os.environ.get("RAY_ADDRESS")
    if address:
        return address
    path = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
    try:
        recorded = open(path).read().strip()
    except OSError:
        return None
    host, _, port = recorded.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=probe_timeout_s):
            return recorded
    except (OSError, ValueError):
        return None
