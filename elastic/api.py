"""The Python API: ``ElasticTrainer(spec).fit() -> RunResult``."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import ray

from elastic import ray_join
from elastic.control.callbacks import Callback, checked
from elastic.control.controller import Controller
from elastic.control.stop import StopSignals
from elastic.errors import JobFailed
from elastic.events import EventLog, RunResult, write_summary
from elastic.ingest.corpus import synthetic_corpus
from elastic.ingest.preflight import check_batch_fits, check_corpus, check_eval_corpus, check_sft_layout
from elastic.models.config import token_shape
from elastic.priority import control_process
from elastic.progress import ProgressDisplay, format_summary
from elastic.report.metrics import start_metrics
from elastic.report.print_report import print_report
from elastic.report.tracking import start_tensorboard
from elastic.run_dirs import check_local_dir, claim_locations, release_run_dir
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
        # Named in errors about the run directory: the flag or the spec key it came from.
        self.run_dir_field = "--run-dir" if run_dir is not None else "run_dir"
        if run_dir is not None and not run_dir.strip():  # '' was the default directory under ./runs
            from elastic.errors import SpecError

            raise SpecError("--run-dir", "must name a directory, got an empty string")
        self.run_dir = os.path.abspath(run_dir or spec.run_dir or _default_run_dir(spec.name))
        self.address = address
        self.resume = resume
        self.callbacks = checked(callbacks or [])  # a TypeError now, not a silently ignored hook
        self.step_hook = step_hook  # acts inside every worker step (fault injection: docs/faults.md)
        self.progress = progress
        self.report = report  # write RUN_DIR/report at the end and print its path (docs/observability.md)
        self.result: RunResult | None = None
        self._resume_step: int | None = None  # found before anything starts (_check_before_start)

    @property
    def checkpoint_uri(self) -> str:
        return self.spec.checkpoint.uri or os.path.join(self.run_dir, "checkpoints")

    def fit(self) -> RunResult:
        with control_process():  # the control loop above busy ranks on this host (elastic/priority.py)
            try:
                return self._fit()
            finally:
                release_run_dir(self.run_dir)  # claimed in _check_before_start (elastic/run_dirs.py)

    def _fit(self) -> RunResult:
        target = self._check_before_start()
        started_ray = ray_join.connect(target, _embedded(self.spec)) if target is not None else False
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
        controller: Controller | None = None
        try:
            corpus = self._prepare_data()
            resume = self._resume_step
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
                    self._write_summary(self.result, events)
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
            gcs_lost = controller is not None and controller.gcs.lost() is not None
            if started_ray or gcs_lost:  # a driver whose GCS is gone is ended by Ray 60 s later: leave first
                ray.shutdown()
            if self.report and events.fault() is None:  # nothing more written where writes fail
                print_report(self.run_dir)
        return self.result

    def _write_summary(self, result: RunResult, events: EventLog) -> None:
        """``summary.json``, when the run directory still takes it: a run whose directory
        cannot be written has failed already (the controller ends it on the event log's
        fault, naming the cause); the summary is then best effort, and its own error one
        warning line."""
        try:
            write_summary(self.run_dir, result)
        except OSError as exc:
            if events.fault() is None:  # the event log still writes: a summary the job cannot do without
                raise JobFailed(f"{self.run_dir}/summary.json could not be written: {exc.strerror or exc}") from None
            print(f"warning: summary.json not written: {exc.strerror or exc}", file=sys.stderr)

    def _check_before_start(self) -> ray_join.Target | None:
        """Everything a run needs that can be checked before anything starts, as a ``SpecError``
        naming the field (exit 2): the corpus, the cluster address, the run directory and the
        checkpoint location (reused locations: ``elastic/run_dirs.py``). Returns the cluster
        to join (None: already connected)."""
        seq_len, vocab_size = token_shape(self.spec.model)
        check_sft_layout(check_corpus(self.spec.data, seq_len, vocab_size), self.spec)
        check_eval_corpus(self.spec, seq_len, vocab_size)
        d, t = self.spec.data, self.spec.train
        check_batch_fits(d, t.global_batch)
        if d.source == "synthetic" and d.cache_dir and "://" not in d.cache_dir:
            check_local_dir(d.cache_dir, "data.cache_dir")  # a file there failed after Ray started
        if isinstance(t.tensorboard, str):
            check_local_dir(t.tensorboard, "train.tensorboard")
        if t.warmup > t.steps:  # allowed: a first leg of a run that --resume extends past its warmup
            logger.warning(
                "train.warmup_steps (%d) is more than train.steps (%d): the learning rate stays below "
                "train.lr for the whole run, unless --resume extends it", t.warmup, t.steps,
            )  # fmt: skip
        target = None if ray.is_initialized() else ray_join.resolve(self.address)
        if target is not None and target.address is None:
            check_fits_embedded(self.spec)
        ck = self.spec.checkpoint
        uses_storage = bool(ck.every_steps) or self.resume
        claim_locations(
            self.run_dir,
            self.run_dir_field,
            self.checkpoint_uri if uses_storage else None,
            ck.storage_options,
            self.resume,
            self.spec,
        )
        self._resume_step = self._resume_point() if self.resume else None  # before Ray starts
        return target

    def _prepare_data(self) -> str:
        d = self.spec.data
        if d.source != "synthetic":
            return d.source
        cache = d.cache_dir or os.path.join(self.run_dir, "data")
        seq_len, vocab_size = token_shape(self.spec.model)
        return synthetic_corpus(cache, d.num_samples, seq_len, vocab_size, self.spec.seed)

    def _resume_point(self) -> int | None:
        from elastic.checkpoint.restore import latest_storage_step

        step = latest_storage_step(self.spec, self.checkpoint_uri)
        if step is None:  # none at all, or every one damaged (their bad files were logged)
            from elastic.errors import SpecError
            from storage import redact_uri

            where = redact_uri(self.checkpoint_uri)
            raise SpecError("--resume", f"no valid checkpoint under {where}: nothing to resume; run without --resume")
        return step


def ensure_ray(address: str | None, spec: Any) -> bool:
    """Connect to Ray; returns True when this call started an embedded local instance.

    The convention of ``elastic/ray_join.py`` (DESIGN §10): ``address`` (or ``RAY_ADDRESS``)
    joins that cluster, ``auto`` the running local one; otherwise an embedded Ray sized to
    the job: enough logical CPUs for ``max_dp`` replicas even on a 2-core laptop.
    """
    if ray.is_initialized():
        return False
    return ray_join.connect(ray_join.resolve(address), _embedded(spec))


WORKERS_PER_CORE = 8  # torch workers an embedded cluster may start per core of this machine


def check_fits_embedded(spec: Any, cores: int | None = None, gpus: int | None = None) -> None:
    """An embedded cluster starts ``max_dp`` replicas of ``replica_size`` workers on this one
    machine (it is sized to the job: :func:`_embedded`): more than ``WORKERS_PER_CORE`` a core
    would thrash it for minutes before the first step, so the spec is refused with the
    number that fits (exit 2). A real cluster (``--address``) grows to what it has instead."""
    from elastic.errors import SpecError

    per_worker = spec.resources.gpus_per_worker
    if per_worker > 0:  # the embedded cluster has this machine's GPUs: none waited min_dp_wait_s, then failed
        import torch

        gpus = torch.cuda.device_count() if gpus is None else gpus
        need = spec.elastic.min_dp * spec.parallel.replica_size * per_worker
        if gpus < need:
            raise SpecError(
                "resources.gpus_per_worker" if gpus == 0 else "elastic.min_dp",
                f"{need:g} GPUs are needed for min_dp={spec.elastic.min_dp} replicas, and this machine has {gpus} "
                "that torch can see (an embedded cluster has only those); join a GPU cluster with --address",
            )
    cores = cores or os.cpu_count() or 1
    limit = WORKERS_PER_CORE * cores
    replica = spec.parallel.replica_size
    if replica > limit:
        wide = [k for k in ("tp", "pp", "cp", "ep") if getattr(spec.parallel, k, 1) > 1]
        field = f"parallel.{wide[0]}" if wide else "parallel"
        raise SpecError(
            field,
            f"a replica of {replica} workers is more than the {limit} an embedded cluster starts on "
            f"{cores} cores ({WORKERS_PER_CORE} a core); join a cluster with --address",
        )
    if spec.elastic.max_dp * replica > limit:
        raise SpecError(
            "elastic.max_dp",
            f"{spec.elastic.max_dp} replicas of {replica} workers are more than the {limit} an embedded cluster "
            f"starts on {cores} cores ({WORKERS_PER_CORE} a core): at most {limit // replica} fit here; "
            "or join a cluster with --address",
        )


def _embedded(spec: Any):
    workers = spec.elastic.max_dp * spec.parallel.replica_size
    cpus = max(os.cpu_count() or 1, workers * max(spec.resources.cpus_per_worker, 1) + 1)
    resources = {k: v * workers for k, v in spec.resources.custom.items()}
    return ray_join.embedded(int(cpus), resources=resources or None)


def _default_run_dir(name: str) -> str:
    """``runs/<name>-<UTC timestamp>``, with a suffix when a run started in the same second."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join("runs", f"{name}-{stamp}")
    n = 1
    while os.path.exists(path if n == 1 else f"{path}-{n}"):
        n += 1
    return path if n == 1 else f"{path}-{n}"
