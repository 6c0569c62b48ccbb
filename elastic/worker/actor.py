"""``Rank``: one rank of the built-in language-model trainer, hosted by the Ray actor
``TrainWorker`` (``remote.py``, a shell that only forwards). It exposes typed RPCs and
nothing else.

It is the trainer's payload on the rank runtime (``RankRuntime``, ``runtime.py``: the
process group, the abort of a blocked collective, liveness, the device and the training
thread, shared with a user's loop, ``elastic/train/rank.py``); what is its own is the
``Trainer`` of each generation, the memory tier of snapshots, and the restore.

The rank outlives process groups. ``reconfigure`` re-forms it in place, top-down: leave
the old generation (the trainer's live state kept, if the plan lets it hold it), join the
new one through the runtime, build its mesh and a new ``Trainer``, restore from its own
live state, memory (its own or peers' snapshots) or storage, and start; process, imports
and CPU buffers survive.

The actor's two concurrency groups keep the rank observable while it trains:

* ``train`` (one thread): ``reconfigure`` and ``run``, the only code that touches the model
  or the process group;
* ``control``: ``poll`` (heartbeat and reports), ``request_stop``, snapshot queries and
  transfers. A worker stopped with SIGSTOP answers none of these, which is how the
  controller tells a silent worker from a slow collective.

Errors inside ``run`` are returned as a ``RunOutcome``: after any error the worker leaves
its process group, which frees peers blocked in a collective with it within milliseconds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from elastic.checkpoint.memory_tier import Snapshot
from elastic.checkpoint.peer_fetch import layout_of, needed_owners
from elastic.checkpoint.snapshot_stream import offer, receive_all
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
from elastic.parallel.live import LiveState, held_in_cycles
from elastic.worker.abort import classify
from elastic.worker.device_peak import peak_flops
from elastic.worker.hooks import StepHook
from elastic.worker.outbox import ReportQueue, peer_sender
from elastic.worker.runtime import RankRuntime
from elastic.worker.trainer import Trainer

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 120.0  # a peer's snapshot: its layout, its offer, and its bytes, each
SLOW_PREPARE_S = 2.0  # a rank this late to a rendezvous is logged with where the time went


class Rank:
    """One rank's state and RPCs, hosted by the Ray actor ``remote.TrainWorker``."""

    def __init__(self, spec: Any, corpus_uri: str, step_hook: StepHook | None = None):
        self.spec, self.corpus_uri = spec, corpus_uri
        self.rank = -1
        self._step = 0  # the last trainer's step, while none is built
        self.trainer: Trainer | None = None
        self._kept: LiveState | None = None  # the last generation's live state (elastic/parallel/live.py)
        self._peer_bytes = 0  # snapshot bytes the last restore fetched from peers
        self.corpus: ParquetCorpus | None = None
        device_type = "cuda" if spec.resources.device == "cuda" else "cpu"
        self.runtime = RankRuntime(device_type, spec.elastic.collective_timeout_s)
        self.device = self.runtime.device()
        self.tier = self.runtime.tier
        self._reports = ReportQueue()
        self._runs = 0  # run() calls started: the node agent matches an outcome to its run
        self._outcome: RunOutcome | None = None  # how the last run() ended
        self._stop = threading.Event()
        self.hook = step_hook
        if step_hook is not None:
            step_hook.attach(self._stop, self.runtime.touch)
        # Ray sizes the actor's CPU share; torch would otherwise use every core per worker. A CPU
        # worker keeps the blocks it frees: a re-formation frees and allocates the state's size.
        self.runtime.settle_process(int(spec.resources.cpus_per_worker), keep_freed=True)

    # ------------------------------------------------------------------ control group
    def info(self) -> WorkerInfo:
        return self.runtime.where()

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
        beat = max(self.runtime.beat, trainer.last_progress if trainer is not None else 0.0)
        idle = time.monotonic() - beat
        return PollReply(self.rank, self._step, self.runtime.phase, idle, reports, outcome, runs, first)

    def request_stop(self) -> None:
        self._stop.set()

    def abandon_rendezvous(self, generation: int) -> None:
        """Give up joining ``generation``: a peer was lost while it formed."""
        self.runtime.abandon(generation)

    def abort_step(self, generation: int = 0, links: frozenset = frozenset()) -> None:
        """A peer was lost: leave the step in flight at the next layer, and cut ``links`` (this
        rank's connections to the lost ranks: a collective blocked on one fails now). A snapshot copy
        gives way; a run not over in 5 s logs its stacks and cuts all its links, and one still blocked
        in a collective 1 s later leaves the job (``report_if_stuck``). A late notice: nothing."""
        if generation and generation != self.runtime.generation:
            return
        self.runtime.aborted.set()
        self.runtime.cut(links)
        self.tier.yield_copy()
        self.runtime.leave_if_stuck()

    def shrink_group(self, excluded: tuple[int, ...]) -> bool:
        """A replica was lost (NCCL): shrink the group without ``excluded`` now, which aborts
        the collective the train thread may be blocked in (``ReconfigurableProcessGroup.shrink``).
        A snapshot copy in flight gives way."""
        self.tier.yield_copy()
        return self.runtime.group.shrink(excluded)

    def snapshot_holdings(self, after_run_s: float = 0.0) -> dict[int, list[int]]:
        """Owner rank -> steps this worker can serve from memory; with ``after_run_s``, as of the
        end of the run in progress, waited for that long at most (asked with ``abort_step``)."""
        if after_run_s > 0:
            self.runtime.idle.wait(after_run_s)
        return self.tier.holdings()

    def offer_snapshot(self, owner: int, step: int, timeout_s: float) -> dict[str, Any]:
        """A snapshot this worker holds (its own as ``owner``, or a peer's copy), offered to one
        peer over a TCP connection (``snapshot_stream``); an own one stays leased until sent."""
        snap = self.tier.get(owner, step, lease=True)
        return offer(snap, ray.util.get_node_ip_address(), timeout_s, done=lambda: self.tier.release(snap))

    def snapshot_layout(self, owner: int, step: int) -> dict[str, dict[str, Any]]:
        """The boxes of a snapshot this worker holds, without data (a resharding peer plans with them)."""
        return layout_of(self.tier.get(owner, step))

    def store_replica(self, wire: dict[str, Any]) -> bool:
        """Keep a peer's snapshot; False when it belongs to a layout this worker has left."""
        return self.tier.store_replica(Snapshot.from_wire(wire))

    # ------------------------------------------------------------------ train group
    def reconfigure(self, req: ConfigureRequest) -> ConfigureReply:
        """Join generation ``req.generation`` of the group and get ready to train from ``req.step``.

        On any error it leaves the half-formed group before raising, so that peers blocked
        on this rank fail at once.
        """
        self.runtime.enter("configure")
        self.runtime.touch()
        try:
            return self._reconfigure(req)
        except BaseException:
            self._leave()
            raise
        finally:
            self.runtime.settled()

    def _reconfigure(self, req: ConfigureRequest) -> ConfigureReply:
        """The steps in order: (1) leave the old generation, (2) join the new one and build
        its mesh (the runtime), (3) build the trainer on it, (4) restore, (5) start."""
        # (1) Leave: the trainer's live state is kept for the plan to adopt (``_keepable``).
        cpu0, t_leave = time.process_time(), time.perf_counter()
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
        # (2) Join generation ``req.generation`` through the runtime, then the mesh's sub-groups.
        if self.hook is not None:  # a test's late arrival (elastic/faults/worker.py)
            self.hook.before_join(req.generation, req.rank)
        join_s = self.runtime.join(req.generation, req.rank, world, req.store, req.store_secret, req.shrink_excluded)
        # The mesh's sub-groups connect within the rendezvous timeout, then get the collective one.
        t_mesh = time.perf_counter()
        dims = ParallelDims(
            dp=dp, tp=tp, pp=pp, world_size=world, ep=ep, cp=cp, shard_group=self.spec.parallel.shard_group,
            timeout=self.runtime.group.rendezvous_timeout,
        )  # fmt: skip
        dims.build_mesh(self.device.type)
        self.runtime.group.mesh_built(dims.mesh_groups())
        mesh_s = time.perf_counter() - t_mesh
        store_ops = self.runtime.group.store_ops()
        init_s = join_s + mesh_s  # the rendezvous: the group and its mesh sub-groups
        # (3) Build the trainer (over its data source) on the new mesh.
        kept, self._kept = self._keepable(req), None  # a state not kept is freed before the build
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
            hook=self.hook, peak_flops=peak, source=source, adopt=kept, abort=self.runtime.aborted,
            restoring=req.restore is not None or kept is not None or self._init_from() is not None,
        )  # fmt: skip
        build_s = time.perf_counter() - t0
        self.runtime.built()  # the group's, its mesh's and the trainer's connections, cut on a failure
        # (4) Restore: the live state kept, else memory (own or peers' snapshots) or storage.
        trainer.step = req.step
        t1 = time.perf_counter()
        self._peer_bytes = 0
        if kept is not None:  # a survivor holding the resumed step: restores nothing
            trainer.load_live(kept, self.tier.progress(kept.rank, req.step))  # its copy may still run
            bytes_read = 0
        else:
            bytes_read = self._restore(trainer, req.restore)
        restore_s = time.perf_counter() - t1
        adopted, kept = kept is not None, None
        # (5) Start: snapshots go to this layout's peer; the trainer's streams open.
        self.tier.layout = trainer.layout  # replicas of the old layout arriving late are refused
        timeout = self.spec.elastic.collective_timeout_s
        peer = req.replica_peer
        self.tier.replicate_to(peer_sender(peer, timeout) if peer is not None else None, timeout_s=timeout)
        # Hosts stagger their first reads at a cold start (a job's start, or a restore from
        # storage, when every host reads at once); a re-formation from memory re-opens the
        # streams of a running job and does not wait (docs/data.md).
        stagger = not isinstance(req.restore, MemoryRestore)
        trainer.start(req.host_index if stagger else 0, req.storage_uri)
        self.trainer = trainer
        self._stop.clear()
        self.runtime.ready()
        logger.info(
            "configure gen %d rank %d: join %.3fs mesh %.3fs build %.3fs restore %.3fs%s",
            req.generation, req.rank, join_s, mesh_s, build_s, restore_s, " (kept its live state)" if adopted else "",
        )  # fmt: skip
        cpu_s = time.process_time() - cpu0  # this process's own work: no other rank's shares it on a real cluster
        return ConfigureReply(req.rank, trainer.step, init_s, build_s, restore_s, bytes_read, store_ops, adopted,
                              self._peer_bytes, cpu_s, self.runtime.group.connections())  # fmt: skip

    def _keepable(self, req: ConfigureRequest) -> LiveState | None:
        """This rank's live state, if the plan gives it the same state to hold
        (``req.keep_state``, judged from ``req.prior_rank``, which must be the rank it
        trained as) at the step it resumes from, and its own snapshot of that step is here
        for the step, data position and RNG."""
        kept = self._kept
        if kept is None or not req.keep_state or req.prior_rank != kept.rank or kept.step != req.step:
            return None
        return kept if req.step in self.tier.holdings().get(kept.rank, []) else None

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
            step, holders = restore.step, dict(restore.holders)
            snaps = {o: self.tier.get(o, step) for o, h in holders.items() if h is None}  # held here
            remote = {o: h for o, h in holders.items() if h is not None}
            if len(holders) > 1 and remote:  # resharding: fetch only the shards that overlap this rank's
                refs = {o: h.snapshot_layout.remote(o, step) for o, h in remote.items()}
                layouts = {o: ray.get(r, timeout=FETCH_TIMEOUT_S) for o, r in refs.items()}
                layouts.update({o: layout_of(s) for o, s in snaps.items()})
                need = needed_owners(trainer.restore_target(), layouts, prefer=next(iter(snaps), None))
                needed = {o: h for o, h in remote.items() if o in need}
                remote = needed if needed or snaps else dict([next(iter(remote.items()))])  # (one, for the objects)
            refs = {o: h.offer_snapshot.remote(o, step, FETCH_TIMEOUT_S) for o, h in remote.items()}
            fetched = receive_all({o: ray.get(r, timeout=FETCH_TIMEOUT_S) for o, r in refs.items()}, FETCH_TIMEOUT_S)
            self._peer_bytes = sum(s.nbytes for s in fetched.values())
            trainer.load_snapshots({**snaps, **fetched})
        return 0

    def save_checkpoint(self, timeout_s: float) -> bool:
        """After a stop at a step boundary: write the live step to storage (``elastic/control/stop.py``)."""
        return self.trainer is not None and self.trainer.save_live_step(timeout_s)

    def run(self, last_step: int) -> RunOutcome:
        """Train until ``last_step`` or an agreed stop; errors are returned, not raised."""
        self.runtime.enter("train")
        self._runs, self._outcome = self._runs + 1, None
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("run() before reconfigure(): no trainer")
        trainer.begin_layout()  # every peer has restored by now
        with self.runtime.running():
            outcome = self._train(trainer, last_step)
        if outcome.status == "error":
            # Outside the except block, so the traceback no longer pins the frames that hold
            # the process group: dropping every reference closes its connections, and peers
            # blocked in a collective with this rank fail at once instead of timing out. The
            # trained state itself is kept, for the next generation (``_keepable``).
            self._kept = trainer.release_live()
            del trainer
            self.runtime.leave(collect=held_in_cycles(self._kept))
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
            step = self.trainer.step if self.trainer is not None else 0
            return classify(exc, step, time.monotonic() - trainer.last_progress, self.spec.elastic.collective_timeout_s)

    # ------------------------------------------------------------------ helpers
    def _leave(self) -> None:
        """Drop this generation's trainer and leave its process group."""
        t0 = time.perf_counter()
        if self.trainer is not None:
            self._step = self.trainer.step
            self._kept = self.trainer.release_live() or self._kept
            self.trainer.close()
            self.trainer = None
        t1 = time.perf_counter()
        self.runtime.leave(collect=held_in_cycles(self._kept))
        if time.perf_counter() - t0 > SLOW_PREPARE_S:
            logger.warning(
                "leaving took %.2fs: closing the trainer %.2fs, the process group %.2fs",
                time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1,
            )  # fmt: skip
