"""``TrainWorker``: the Ray actor of one rank. It exposes typed RPCs and nothing else.

The actor outlives process groups. ``configure`` re-forms this rank in place: it leaves
the old group (``ReconfigurableProcessGroup``), joins the new generation, builds a new
``Trainer`` and restores its state from the memory tier (its own snapshots or a peer's) or
from storage. Process, imports and CPU buffers survive; nothing is restarted.

Two concurrency groups keep the actor observable while it trains:

* ``train`` (one thread): ``configure`` and ``run``, the only code that touches the model
  or the process group;
* ``control``: ``poll`` (heartbeat and reports), ``request_stop``, snapshot queries and
  transfers. A worker stopped with SIGSTOP answers none of these, which is how the
  controller tells a silent worker from a slow collective.

Errors inside ``run`` are returned as a ``RunOutcome``, never raised mid-collective: after
any error the worker leaves its process group, which frees peers blocked in a collective
with it within milliseconds.
"""

from __future__ import annotations

import collections
import faulthandler
import gc
import logging
import os
import signal
import threading
import time
from typing import Any

import ray
import torch

from elastic.checkpoint.memory_tier import MemoryTier, Snapshot
from elastic.errors import CorpusError
from elastic.ingest.corpus import ParquetCorpus
from elastic.messages import (
    ConfigureReply,
    ConfigureRequest,
    MemoryRestore,
    PollReply,
    RunOutcome,
    StorageRestore,
    WorkerInfo,
)
from elastic.parallel.dims import ParallelDims
from elastic.worker.hooks import StepHook
from elastic.worker.process_group import ReconfigurableProcessGroup, is_collective_error
from elastic.worker.trainer import Trainer

logger = logging.getLogger(__name__)

CONCURRENCY_GROUPS = {"train": 1, "control": 4}
SLOW_PREPARE_S = 2.0  # a rank this late to a rendezvous is logged with where the time went

# Dense peak FLOP/s per device and compute precision, for MFU (vendor data sheets, SXM parts);
# None where unknown (CPU). bf16 is the default on CUDA (``train.dtype``).
_PEAK = {
    "bf16": {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362.05e12},
    "fp32": {"H200": 494.7e12, "H100": 494.7e12, "A100": 156e12, "L40S": 183e12},  # TF32 tensor cores
}


def peak_flops(device: torch.device, dtype: str = "fp32") -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK.get(dtype, {}).items() if k in name), None)


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS, max_restarts=0)
class TrainWorker:
    def __init__(self, spec: Any, corpus_uri: str, step_hook: StepHook | None = None):
        self.spec = spec
        self.corpus_uri = corpus_uri
        self.rank = -1
        self._step = 0  # the last trainer's step, while none is built
        self.trainer: Trainer | None = None
        self.corpus: ParquetCorpus | None = None
        self.device = self._pick_device()
        self.tier = MemoryTier(self.device.type)
        self.group = ReconfigurableProcessGroup(self.device.type, spec.elastic.collective_timeout_s)
        self._reports = ReportQueue()
        self._beat = time.monotonic()
        self._phase = "idle"
        self._runs = 0  # run() calls started: the node agent matches an outcome to its run
        self._outcome: RunOutcome | None = None  # how the last run() ended
        self._stop = threading.Event()
        self.hook = step_hook
        if step_hook is not None:
            step_hook.attach(self._stop, self._touch_beat)
        # `kill -USR1 <pid>` dumps every thread's stack to the worker's log: how to see
        # where a hung rank is stuck.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # Ray sizes the actor's CPU share; torch would otherwise use every core per worker.
        torch.set_num_threads(max(1, int(spec.resources.cpus_per_worker)))
        # Everything alive now (torch, Ray, imported modules: ~300k objects) lives as long as
        # the process. Freezing it keeps the full collections that leaving a process group
        # makes (to release the old group) from scanning it again: ~40 ms saved per
        # collection here, several times per re-formation (benchmarks/reconfigure_profile.py).
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------------ control group
    @ray.method(concurrency_group="control")
    def info(self) -> WorkerInfo:
        return WorkerInfo(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    # Task events (Ray's per-task state records sent to the GCS) are off for the polls: they
    # come several times a second per rank and nobody reads them.
    @ray.method(concurrency_group="control", enable_task_events=False)
    def poll(self, wait_s: float = 0.0, ack: int | None = None, have: int | None = None) -> PollReply:
        """Heartbeat: progress counters plus the reports produced since the last poll.

        With ``wait_s``, a long poll: it answers as soon as a report is produced, or after
        ``wait_s`` with none, so that a step's result reaches the driver within
        milliseconds rather than at its next look. Its node agent (``elastic/agent/``) passes
        ``have`` (the last report it has) and ``ack`` (the last one the driver has): reports
        are kept until acked, so an agent that replaces a lost one gets them all again.
        Without them, every report is handed over once.
        """
        after = -1 if have is None else have
        if wait_s > 0 and not self._reports.has_after(after):
            self._reports.ready.wait(wait_s)
        elif wait_s <= 0:  # a flush: a long poll in flight answers now too, with what it has
            self._reports.ready.set()
        self._reports.ready.clear()
        # The outcome is read before the reports are taken: every report a run made is in
        # the queue by the time its outcome is set, so a reply with the outcome has them all.
        outcome, runs = self._outcome, self._runs
        first, reports = self._reports.take(ack, after, keep=have is not None)
        trainer = self.trainer
        if trainer is not None:
            self._step = trainer.step
        beat = max(self._beat, trainer.last_progress if trainer is not None else 0.0)
        idle = time.monotonic() - beat
        return PollReply(self.rank, self._step, self._phase, idle, reports, outcome, runs, first)

    def _touch_beat(self) -> None:
        self._beat = time.monotonic()

    @ray.method(concurrency_group="control")
    def request_stop(self) -> None:
        self._stop.set()

    @ray.method(concurrency_group="control")
    def abandon_rendezvous(self, generation: int) -> None:
        """Give up joining ``generation``: a peer was lost while it formed."""
        self.group.abandon(generation)

    @ray.method(concurrency_group="control")
    def snapshot_holdings(self) -> dict[int, list[int]]:
        """Owner rank -> steps this worker can serve from memory."""
        return self.tier.holdings()

    @ray.method(concurrency_group="control")
    def fetch_snapshot(self, owner: int, step: int) -> dict[str, Any]:
        """A snapshot this worker holds (its own as rank ``owner``, or a peer's copy), in
        ``Snapshot.to_wire`` form."""
        return self.tier.get(owner, step).to_wire()

    @ray.method(concurrency_group="control")
    def store_replica(self, wire: dict[str, Any]) -> bool:
        """Keep a peer's snapshot; False when it belongs to a layout this worker has left."""
        return self.tier.store_replica(Snapshot.from_wire(wire))

    # ------------------------------------------------------------------ train group
    @ray.method(concurrency_group="train")
    def configure(self, req: ConfigureRequest) -> ConfigureReply:
        """Join generation ``req.generation`` of the group and get ready to train from ``req.step``.

        On any error it leaves the half-formed group before raising, so that peers blocked
        on this rank fail at once.
        """
        try:
            return self._configure(req)
        except BaseException:
            self._leave()
            raise
        finally:
            self.group.settled()

    def _configure(self, req: ConfigureRequest) -> ConfigureReply:
        self._phase = "configure"
        self._beat = time.monotonic()
        t_leave = time.perf_counter()
        self._leave()
        t_tier = time.perf_counter()
        self.tier.replicate_to(None)  # nothing of the old layout is sent from now on
        t_join = time.perf_counter()
        if t_join - t_leave > SLOW_PREPARE_S:  # what delays a rank's arrival at the rendezvous
            logger.warning(
                "configure gen %d rank %d: %.2fs before the rendezvous (leave %.2fs, memory tier %.2fs)",
                req.generation, req.rank, t_join - t_leave, t_tier - t_leave, t_join - t_tier,
            )  # fmt: skip
        dp, tp, pp = req.dims
        ep, cp = self.spec.parallel.ep, self.spec.parallel.cp  # fixed for the job: only dp changes
        world = dp * tp * pp * ep * cp
        self.rank = req.rank
        join_s = self.group.configure(req.generation, req.rank, world, req.store)
        # The mesh's sub-groups connect within the rendezvous timeout, then get the collective one.
        t_mesh = time.perf_counter()
        dims = ParallelDims(dp=dp, tp=tp, pp=pp, world_size=world, ep=ep, cp=cp, timeout=self.group.rendezvous_timeout)
        dims.build_mesh(self.device.type)
        self.group.mesh_built(dims.mesh_groups())
        mesh_s = time.perf_counter() - t_mesh
        init_s = join_s + mesh_s  # the rendezvous: the group and its mesh sub-groups
        source = None
        if req.read_plan is not None:  # a prepared corpus: read through the replica's host feeder
            from elastic.ingest.host_readers import FeederSource

            source = FeederSource(req.read_plan, self.spec.data, self.spec.elastic.collective_timeout_s)
        elif self.corpus is None:
            self.corpus = ParquetCorpus(self.corpus_uri, self.spec.data.storage_options)
        peak = peak_flops(self.device, self.spec.train.resolved_dtype(self.device.type))
        t0 = time.perf_counter()
        trainer = Trainer(
            self.spec, dims, req.rank, self.device, self.tier, self.corpus, self._reports, self._stop,
            hook=self.hook, peak_flops=peak, source=source,
            restoring=req.restore is not None or self._init_from() is not None,
        )  # fmt: skip
        build_s = time.perf_counter() - t0
        self.group.built()  # the group's and its mesh's connections, cut on a failure
        trainer.step = req.step
        t1 = time.perf_counter()
        bytes_read = self._restore(trainer, req.restore)
        restore_s = time.perf_counter() - t1
        self.tier.layout = trainer.layout  # replicas of the old layout arriving late are refused
        timeout = self.spec.elastic.collective_timeout_s
        peer = req.replica_peer
        self.tier.replicate_to(_sender(peer, timeout) if peer is not None else None, timeout_s=timeout)
        # Hosts stagger their first reads at a cold start (a job's start, or a restore from
        # storage, when every host reads at once); a re-formation from memory re-opens the
        # streams of a running job and does not wait (docs/data.md).
        stagger = not isinstance(req.restore, MemoryRestore)
        trainer.start(req.host_index if stagger else 0, req.storage_uri)
        self.trainer = trainer
        self._stop.clear()
        self._phase = "ready"
        self._beat = time.monotonic()
        logger.info(
            "configure gen %d rank %d: join %.3fs mesh %.3fs build %.3fs restore %.3fs",
            req.generation, req.rank, join_s, mesh_s, build_s, restore_s,
        )  # fmt: skip
        return ConfigureReply(req.rank, trainer.step, init_s, build_s, restore_s, bytes_read)

    def _init_from(self) -> str | None:
        return getattr(self.spec.model, "init_from", None)

    def _restore(self, trainer: Trainer, restore: MemoryRestore | StorageRestore | None) -> int:
        """Load ``restore`` into ``trainer``; returns the bytes read from storage.

        No state to restore is a start from step 0: from ``model.init_from`` when set (a
        snapshot or checkpoint, when there is one, holds trained weights and wins)."""
        if restore is None and self._init_from() is not None:
            return trainer.load_init_from()["bytes_read"]
        if isinstance(restore, StorageRestore):
            return trainer.load_storage(restore)["bytes_read"]
        if isinstance(restore, MemoryRestore):
            snaps: dict[int, Snapshot] = {}
            for owner, holder in restore.holders.items():
                if holder is None:  # this worker holds it itself
                    snaps[owner] = self.tier.get(owner, restore.step)
                else:
                    wire = ray.get(holder.fetch_snapshot.remote(owner, restore.step), timeout=120)
                    snaps[owner] = Snapshot.from_wire(wire)
            trainer.load_snapshots(snaps)
        return 0

    @ray.method(concurrency_group="train")
    def save_checkpoint(self, timeout_s: float) -> bool:
        """After a stop at a step boundary: write the live step to storage (``elastic/control/stop.py``)."""
        return self.trainer is not None and self.trainer.save_live_step(timeout_s)

    @ray.method(concurrency_group="train")
    def run(self, last_step: int) -> RunOutcome:
        """Train until ``last_step`` or an agreed stop; errors are returned, not raised."""
        self._phase = "train"
        self._runs, self._outcome = self._runs + 1, None
        trainer = self.trainer
        self.tier.keep_layout(trainer.layout)  # every peer has restored by now
        try:
            outcome = self._train(trainer, last_step)
        finally:
            self._phase = "idle"
            self._beat = time.monotonic()
        if outcome.status == "error":
            # Outside the except block, so the traceback no longer pins the frames that hold
            # the process group: dropping every reference closes its connections, and peers
            # blocked in a collective with this rank fail at once instead of timing out.
            trainer.drop_engine()
            del trainer
            self.group.leave()
        self._outcome = outcome  # the node agent reads it with the next poll (elastic/agent/)
        self._reports.ready.set()
        return outcome

    def _train(self, trainer: Trainer, last_step: int) -> RunOutcome:
        try:
            while trainer.step < last_step:
                if trainer.train_step():
                    trainer.snapshot_now()
                    return RunOutcome("stopped", trainer.step)
            self.tier.wait()
            return RunOutcome("done", trainer.step)
        except Exception as exc:
            return self._classify(exc, time.monotonic() - trainer.last_progress)

    def _classify(self, exc: Exception, blocked_s: float) -> RunOutcome:
        """Whose failure: a collective's (a peer went away, or it timed out) or this rank's own.

        By exception type (see ``is_collective_error``) and by how long the failing call
        was blocked, never by message text.
        """
        detail = f"{type(exc).__name__}: {str(exc)[:300]}"
        step = self.trainer.step if self.trainer is not None else 0
        if not is_collective_error(exc):
            return RunOutcome("error", step, "worker_error", detail, retryable=not isinstance(exc, CorpusError))
        timed_out = blocked_s >= 0.9 * self.spec.elastic.collective_timeout_s
        return RunOutcome("error", step, "timeout" if timed_out else "peer", detail)

    # ------------------------------------------------------------------ helpers
    def _pick_device(self) -> torch.device:
        if self.spec.resources.device == "cuda":
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _leave(self) -> None:
        """Drop this generation's trainer and leave its process group."""
        t0 = time.perf_counter()
        if self.trainer is not None:
            self._step = self.trainer.step
            self.trainer.close()
            self.trainer = None
        t1 = time.perf_counter()
        self.group.leave()
        if time.perf_counter() - t0 > SLOW_PREPARE_S:
            logger.warning(
                "leaving took %.2fs: closing the trainer %.2fs, the process group %.2fs",
                time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1,
            )  # fmt: skip


class ReportQueue:
    """The reports the worker's ``poll`` hands over, numbered from 1; ``ready`` is set by
    every append. The trainer only appends. Reports are kept until acked (at most ``KEEP``
    of them: the oldest go first), for a node agent that replaces a lost one."""

    KEEP = 4096

    def __init__(self) -> None:
        self._items: collections.deque[tuple[int, Any]] = collections.deque()
        self._seq = 0
        self._lock = threading.Lock()
        self.ready = threading.Event()

    def append(self, item: Any) -> None:
        with self._lock:
            self._seq += 1
            self._items.append((self._seq, item))
            if len(self._items) > self.KEEP:
                self._items.popleft()
        self.ready.set()

    def has_after(self, have: int) -> bool:
        with self._lock:
            return bool(self._items) and self._items[-1][0] > have

    def take(self, ack: int | None, have: int, keep: bool) -> tuple[int, list[Any]]:
        """(the first's number, the reports after ``have``); those up to ``ack`` are dropped
        first, and without ``keep`` the ones handed over too."""
        with self._lock:
            while self._items and ack is not None and self._items[0][0] <= ack:
                self._items.popleft()
            out = [(s, r) for s, r in self._items if s > have]
            if not keep:
                self._items.clear()
        return (out[0][0] if out else 0), [r for _, r in out]


def _sender(peer: Any, timeout_s: float):
    """Deliver a snapshot to ``peer`` (a TrainWorker): serialise now, confirm later."""

    def send(snap: Snapshot):
        ref = peer.store_replica.remote(snap.to_wire())  # the arguments are serialised here

        def delivered() -> None:
            if not ray.get(ref, timeout=timeout_s):
                raise RuntimeError(f"the peer refused the snapshot of step {snap.step}: it has left that layout")

        return delivered

    return send
