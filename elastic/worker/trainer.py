"""The training loop of one rank, with no Ray in it.

A ``Trainer`` lives for one generation of the process group: the worker builds a new one
after every re-formation (``elastic/worker/actor.py``), hands it the restored state, and
calls ``train_step`` until the run ends or the group agrees to stop. Per step:

1. read this DP rank's micro-batches (prefetched; the wait is ``data_wait_s``);
2. forward and backward, agreeing with every rank on "stop after this step";
3. check the loss: a NaN or spike rolls back to the newest own snapshot instead (with SDC
   checks on, replicas whose parameters disagree roll back to the verified state and
   retrain the same batch: the hardware's fault, not the data's);
4. optimizer step (after any snapshot copy of the previous step has finished);
5. snapshot the state to the memory tier (and hand it to the storage tier when due);
6. report the step.

Reports go to ``reports`` (a deque the worker's ``poll`` drains), as the typed messages of
``elastic/messages.py``.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from elastic.checkpoint.memory_tier import MemoryTier, Snapshot
from elastic.checkpoint.restore import flat_target, load_from_storage, load_live_into, load_snapshots_into
from elastic.checkpoint.storage_tier import StorageUploader
from elastic.engine import TrainEngine
from elastic.ingest.corpus import BatchLayout, ParquetCorpus, RankStream, ray_data_batches
from elastic.ingest.eval_rows import eval_micro_batches
from elastic.ingest.preflight import check_rows
from elastic.messages import (
    AnomalyReport,
    EvalReport,
    ReportSink,
    SdcReport,
    SnapshotReport,
    StepReport,
    StorageRestore,
)
from elastic.parallel.dims import ParallelDims
from elastic.parallel.live import LiveState, release
from elastic.worker.abort import AbortHooks
from elastic.worker.anomaly import AnomalyCause, LossMonitor
from elastic.worker.hooks import StepHook
from elastic.worker.rng import capture_rng, restore_rng
from elastic.worker.sdc import SdcGuard


class Trainer:
    def __init__(
        self,
        spec: Any,
        dims: ParallelDims,
        rank: int,
        device: Any,
        tier: MemoryTier,
        corpus: ParquetCorpus | None,  # None when a host feeder supplies the batches
        reports: ReportSink,
        stop: threading.Event,
        hook: StepHook | None = None,
        peak_flops: float | None = None,
        source: Any = None,
        restoring: bool = False,
        adopt: LiveState | None = None,
        abort: threading.Event | None = None,
    ):
        self.spec, self.dims, self.rank, self.tier, self.corpus = spec, dims, rank, tier, corpus
        self.reports, self.stop, self.hook, self.peak_flops = reports, stop, hook, peak_flops
        # ``restoring``: state is loaded right after the build (no fresh weights to agree on).
        # ``adopt``: this rank's live state from the last generation (elastic/parallel/live.py).
        self._engine: TrainEngine | None = TrainEngine(
            spec.model, spec.parallel, spec.train, dims, spec.seed, device=str(device), restoring=restoring, adopt=adopt
        )
        self.monitor = LossMonitor(spec.elastic.loss_spike_factor)
        self.step = 0
        self.batch_index = 0
        self.skip_batches: set[int] = set()
        self.stream: RankStream | None = None
        self.uploader: StorageUploader | None = None
        self.last_progress = time.monotonic()  # the loop's own heartbeat
        self._snapshot_blocking = 0.0
        self._live_from: int | None = None  # load_live: the rank whose own snapshot holds this state
        self.source = source  # opens this rank's batch stream when set (elastic.ingest.host_readers.FeederSource)
        self.sdc = SdcGuard(spec, dims, rank, tier)  # silent data corruption checks (docs/health.md)
        # A peer was lost (``TrainWorker.abort_step``): leave the step at the next block.
        self.abort = abort or threading.Event()
        self._eval_batches: list[tuple] | None = None  # this data shard's share of data.eval_source
        self._eval_rows = 0
        blocks = [] if spec.train.compile else self.engine.spec.blocks(self.engine.module)  # (no graph breaks)
        self._abort_hooks = AbortHooks(self.abort, blocks)  # elastic/worker/abort.py

    @property
    def engine(self) -> TrainEngine:
        """The engine of this generation; gone after ``release_live``, ``drop_engine`` or ``close``."""
        if self._engine is None:
            raise RuntimeError("the trainer's engine was released (after a failure, a re-formation or close)")
        return self._engine

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.dims.dp, "tp": self.dims.tp, "pp": self.dims.pp, "zero": self.spec.parallel.zero}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "app": self.engine.state_dict(),
            "train": {
                "step": self.step,
                "batch_index": self.batch_index,
                "skip_batches": sorted(self.skip_batches),
                "rng": capture_rng(),
            },
        }

    def load_snapshots(self, snaps: dict[int, Snapshot]) -> None:
        """Restore from memory-tier snapshots (this rank's own, or resharded from several)."""
        load_snapshots_into(self.engine, snaps)
        self._load_progress(next(iter(snaps.values())).objects)
        restore_rng(_rng_of(next(iter(snaps.values())).objects))

    def restore_target(self) -> dict[str, Any]:
        """This rank's tensors by snapshot path (what a restore fills; DTensors kept)."""
        return flat_target(self.engine)[0]

    def load_live(self, live: LiveState, objects: dict[str, Any]) -> None:
        """Resume a survivor from its own live state (the module kept whole, or its shards
        copied in); the step, data position and RNG from its own snapshot's ``objects``."""
        if live.params is not None:
            load_live_into(self.engine, live, objects)
        self._load_progress(objects)
        restore_rng(_rng_of(objects))
        self._live_from = live.rank  # its own snapshot of this step holds this very state

    def release_live(self) -> LiveState | None:
        """Let go of the engine (its process groups and wrappers) and keep its state."""
        self._abort_hooks.remove()  # a kept module carries no hook of this trainer
        if self._engine is None:
            return None
        live, self._engine = release(self._engine, self.step, self.rank), None
        return live

    def load_storage(self, restore: StorageRestore) -> dict[str, Any]:
        """Restore from a storage checkpoint; returns what this rank read."""
        d = self.spec.data  # the restore's reads follow the data's waves (docs/data.md)
        objects, stats = load_from_storage(
            self.engine, restore.step, restore.uri, restore.storage_options, d.waves, d.max_reads_per_host
        )
        self._load_progress(objects)
        restore_rng(_rng_of(objects))
        return stats

    def load_init_from(self) -> dict[str, Any]:
        """A fresh start from ``model.init_from`` (a Hugging Face directory); returns what was read."""
        from elastic.checkpoint.hf_import import load_init_from

        d = self.spec.data  # staggered like a restore from storage
        return load_init_from(self.engine, self.spec.model.init_from, d.waves, d.max_reads_per_host)

    def _load_progress(self, objects: dict[str, Any]) -> None:
        self.step = int(objects["train/step"])
        self.batch_index = int(objects["train/batch_index"])
        self.skip_batches = set(objects.get("train/skip_batches", []))

    # ------------------------------------------------------------------ start and stop
    def start(self, host_index: int, storage_uri: str | None) -> None:
        """Open the data stream (after this host's stagger slot) and the storage tier
        (at ``storage_uri``, else ``checkpoint.uri``)."""
        self.stream = self._open_stream(self.batch_index, host_index * self.spec.data.stagger_s)
        self.uploader = StorageUploader.create(
            self.spec, storage_uri, self.rank, self.dims, self.tier, self.reports, base_step=self.step
        )

    def drop_engine(self) -> None:
        """After a failure: let go of the model and its process groups (the stream and the
        uploads of finished steps stay until the next generation replaces this trainer)."""
        self._engine = None

    def close(self) -> None:
        """Stop the stream and drop the storage uploads of this generation."""
        if self.uploader is not None:
            self.uploader.close()
        if self.stream is not None:
            self.stream.close()
        if self.source is not None:
            self.source.close()
        self._abort_hooks.remove()
        self._engine = None

    # ------------------------------------------------------------------ the step
    def train_step(self) -> bool:
        """One optimizer step; returns True when the group agreed to stop after it."""
        step = self.step + 1
        self.sdc.baseline(self)
        t0 = time.perf_counter()
        timeout = self.spec.elastic.collective_timeout_s
        batch_index, micro_batches = self._stream().next(timeout=timeout)
        while batch_index in self.skip_batches:
            batch_index, micro_batches = self._stream().next(timeout=timeout)
        data_wait_s = time.perf_counter() - t0
        if self.hook is not None:
            if self.hook.pending(step, self.rank):
                self.tier.wait()  # corrupt nothing while the last snapshot is being copied
            self.hook.before_step(step, self.rank, self.engine)
        t1, c1 = time.perf_counter(), time.thread_time()
        self.last_progress = time.monotonic()
        loss, stop = self.engine.forward_backward_agree(micro_batches, self.stop.is_set)
        self.last_progress = time.monotonic()
        anomaly = self.monitor.check(loss)
        if anomaly is not None:
            # With SDC checks on, ask the replicas first: if their parameters disagree, the
            # NaN or spike came from the hardware (a flipped bit), not from the batch, so the
            # verified state is restored and the same batch is trained again. Only a loss
            # every replica agrees on is the data's fault, and its batch is skipped.
            self.engine.zero_grad()
            if self.sdc.enabled and self._sdc_rolled_back(step):
                return stop
            self._roll_back(step, batch_index, loss, anomaly)
            return stop
        wait_s = self.tier.wait()
        grad_norm = self.engine.optimizer_step()
        compute_s = self._own_compute(t1, c1, wait_s)
        if self.sdc.due(step) and self._sdc_rolled_back(step):
            return stop
        self.monitor.accept(loss)
        self.step, self.batch_index = step, batch_index + 1
        step_time = time.perf_counter() - t0
        snapshot = self._snapshot(step, wait_s)
        mfu = None
        if self.peak_flops:  # model FLOPs of the global step over what every device could do meanwhile
            mfu = self.engine.flops_per_step / (step_time * self.dims.world_size * self.peak_flops)
        self.reports.append(
            StepReport(
                step=step,
                loss=loss,
                grad_norm=grad_norm,
                step_time_s=step_time,
                batch_index=batch_index,
                peak_mem_bytes=self.engine.peak_mem_bytes(),
                done_at=time.time(),
                data_wait_s=data_wait_s,
                compute_s=compute_s,
                mfu=mfu,
                snapshot=snapshot,
            )
        )
        self.last_progress = time.monotonic()
        every = self.spec.train.eval_every
        if every and step % every == 0:
            self._evaluate(step)
        return stop

    def _evaluate(self, step: int) -> None:
        """The mean loss over the whole ``data.eval_source`` after ``step``: this data shard's
        share (``elastic.ingest.eval_rows``, read once per generation), no gradient, summed
        over the shards by ``TrainEngine.eval_loss``; reported as an ``EvalReport``."""
        t = time.perf_counter()
        if self._eval_batches is None:
            d = self.spec.data
            corpus = ParquetCorpus(d.eval_source, d.storage_options)
            shard = self.dims.data_shard(self.dims.coords(self.rank))
            m = self.spec.model
            self._eval_batches = eval_micro_batches(
                corpus, self.dims.data_shards, shard, self.spec.parallel.micro_batch,
                lambda rows, where: check_rows(rows, m.seq_len + 1, m.vocab_size, where),
            )  # fmt: skip
            self._eval_rows = corpus.num_rows
        self.last_progress = time.monotonic()
        loss = self.engine.eval_loss(self._eval_batches, progress=self._beat)
        self.last_progress = time.monotonic()
        self.reports.append(EvalReport(step, loss, time.perf_counter() - t, self._eval_rows))

    def _beat(self) -> None:
        self.last_progress = time.monotonic()

    def _own_compute(self, t1: float, c1: float, wait_s: float) -> float:
        """This rank's own forward, backward and optimizer step, without waiting for peers
        (what straggler detection compares, docs/health.md). On a GPU: the wall time less
        the gradient-sync and loss all-reduce waits. On CPU: the training thread's CPU time, which
        neither those waits nor the scheduler's sharing of cores with other processes add to."""
        if self.engine.device.type == "cpu":
            return time.thread_time() - c1
        return time.perf_counter() - t1 - wait_s - self.engine.sync_wait_s

    def _snapshot(self, step: int, wait_s: float) -> SnapshotReport | None:
        """Snapshot this step when due; report the snapshot that completed since the last step.

        ``blocking_s`` is what the loop was held for: starting the copy, plus any wait for it
        to finish before the next optimizer step.
        """
        done = self.tier.unreported()
        report = None
        if done:
            s = done[-1]
            report = SnapshotReport(s.step, self._snapshot_blocking + wait_s, s.copy_s, s.nbytes)
        ck = self.spec.checkpoint
        uploader = self.uploader if self.uploader is not None and self.uploader.due(step) else None
        to_storage = uploader is not None
        if to_storage or (ck.memory_every_steps and step % ck.memory_every_steps == 0) or self.sdc.due(step):
            t = time.perf_counter()
            state = self.state_dict()
            gather_s = time.perf_counter() - t
            self._snapshot_blocking = gather_s + self.tier.snapshot_async(step, self.rank, state, self.layout)
            if uploader is not None:
                uploader.save(step, state, self._snapshot_blocking)
            if self.sdc.due(step):
                self.sdc.passed(step)
        if self.uploader is not None:
            self.uploader.secure(step)
        return report

    def save_live_step(self, timeout_s: float) -> bool:
        """After a stop at a step boundary (``elastic/control/stop.py``): write the live step
        to the storage tier and wait for the upload (its ``UploadReport`` goes out with the
        next poll). A step the tier already took on its schedule is not written twice.
        False when there is no storage tier."""
        if self.uploader is None or self.step == 0:
            return False
        if not self.uploader.due(self.step):
            self.snapshot_now()
            self.uploader.save(self.step, self.state_dict(), 0.0)
        self.uploader.flush(timeout_s)
        return True

    def begin_layout(self) -> None:
        """Before this layout's first step (every peer has restored): hold the step it resumes
        from under this layout (else a failure before its first snapshot restarted from step
        0): a survivor that kept its live state relabels its own snapshot of that step (no
        copy), any other rank snapshots it in the background; then forget other layouts'."""
        prior, self._live_from = self._live_from, None
        due = self.step > 0 and bool(self.spec.checkpoint.memory_every_steps)
        if due and prior is not None:
            self.tier.relabel(self.step, prior, self.rank, self.layout)
        self.tier.keep_layout(self.layout)
        if due and not self.tier.holds_own(self.step, self.rank, self.layout):
            t = time.perf_counter()
            state = self.state_dict()
            self._snapshot_blocking = time.perf_counter() - t
            self._snapshot_blocking += self.tier.snapshot_async(self.step, self.rank, state, self.layout)

    def snapshot_now(self) -> None:
        """Make sure the memory tier holds the live step (a resize restores from it)."""
        self.tier.wait()
        if self.step not in self.tier.steps():
            self.tier.snapshot_async(self.step, self.rank, self.state_dict(), self.layout)
            self.tier.wait()

    def _roll_back(self, step: int, batch_index: int, loss: float, cause: AnomalyCause) -> None:
        """A NaN or spiking loss: do not commit; restore the newest own snapshot."""
        self.engine.zero_grad()
        self.tier.wait()
        snap = self.tier.newest()
        if snap is not None:  # the weights and counters of that step; the RNG goes on
            load_snapshots_into(self.engine, {self.rank: snap})
            self.step = snap.step
            resume_batch = int(snap.objects["train/batch_index"])
        else:  # nothing to roll back to: the live state is still the last committed one
            resume_batch = batch_index
        if self.spec.elastic.on_bad_loss == "skip":
            self.skip_batches.add(batch_index)
        skipping_this = resume_batch == batch_index and batch_index in self.skip_batches
        if resume_batch != self._stream().next_batch and not skipping_this:
            self._stream().close()
            self.stream = self._open_stream(resume_batch, 0.0)
        self.batch_index = resume_batch
        self.reports.append(
            AnomalyReport(
                cause=cause,
                step=step,
                loss=loss if math.isfinite(loss) else None,
                batch_index=batch_index,
                restored_step=self.step,
                action=self.spec.elastic.on_bad_loss,
            )
        )

    def _sdc_rolled_back(self, step: int) -> bool:
        """The SDC check of ``step`` (every rank reaches the same verdict); on a mismatch,
        roll back to the last verified snapshot and report it. True when rolled back."""
        verdict = self.sdc.check(self.engine)
        if verdict.ok:
            return False
        t = time.perf_counter()
        verified = self.sdc.verified
        if verified is None:  # ``baseline`` sets it before the first step of a checked run
            raise RuntimeError("SDC check: no verified step to roll back to (baseline not taken)")
        if self.sdc.initial is not None and verified == 0:  # nothing verified since a fresh start
            self.sdc.restore_initial(self.engine)
            self.step, self.batch_index, self.skip_batches = 0, 0, set()
        else:
            snap = self.tier.get(self.rank, verified)
            load_snapshots_into(self.engine, {self.rank: snap})
            self._load_progress(snap.objects)
            restore_rng(_rng_of(snap.objects))
        self.tier.discard_after(verified)
        self._stream().close()
        self.stream = self._open_stream(self.batch_index, 0.0)
        odd = self.sdc.odd_replica(verdict)
        self.reports.append(SdcReport(step, verdict.odd, odd, verdict.decided, verified, time.perf_counter() - t))
        return True

    def _stream(self) -> RankStream:
        if self.stream is None:
            raise RuntimeError("train_step() before start(): no data stream")
        return self.stream

    def _open_stream(self, start_batch: int, delay_s: float) -> RankStream:
        d = self.spec.data
        # One slice of each batch per data shard: dp x ep of them (EP ranks train on their own samples).
        layout = BatchLayout(self.spec.train.global_batch, self.spec.parallel.micro_batch, self.dims.data_shards)
        coords = self.dims.coords(self.rank)
        dp_rank = self.dims.data_shard(coords)
        source, loader = None, "native"
        if self.source is not None:  # the host feeder staggers hosts by waves itself
            source, delay_s, loader = self.source.open(layout, dp_rank, start_batch), 0.0, "host reader"
        elif d.loader == "ray_data":
            loader = "ray_data"
            remaining = self.spec.train.steps - self.step + 64  # enough to finish, with room for skipped batches
            if self.corpus is None:
                raise RuntimeError("data.loader ray_data needs the corpus, and this rank was given none")
            source = ray_data_batches(
                self.corpus.uri, d.storage_options, layout, dp_rank, start_batch, remaining, d.prefetch_steps
            )
        return RankStream(
            self.corpus, layout, dp_rank, start_batch, prefetch=d.prefetch_steps, start_delay_s=delay_s, source=source,
            seq_chunk=(self.dims.cp, coords.cp_rank), row_check=self._check_rows, loader=loader,
        )  # fmt: skip

    def _check_rows(self, rows: Any, batch_index: int) -> None:
        """Rows of the wrong width or ids outside the vocabulary: a ``CorpusError`` (not retried)."""
        m = self.spec.model
        check_rows(rows, m.seq_len + 1, m.vocab_size, f"{self.spec.data.source} batch {batch_index}")


def _rng_of(objects: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("train/rng/"): v for k, v in objects.items() if k.startswith("train/rng/")}
