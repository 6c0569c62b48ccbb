"""The elastic controller: one class, ``Controller``, the state machine that drives a run.
In the order of this file: the main loop, starting, running, growing back, the notices it
acts on (a stop signal, drained nodes), a graceful stop, the re-formations (recovering
from a failure, resizing without one) and the step accounting (the reports ranks send,
the steps they commit, the rollbacks done in place: NaN, spike, SDC).

Where it runs: in the driver process (the process of ``elastic run``, of the Python API,
or of a ``ray job submit`` entrypoint). The driver already owns the run's lifetime, the
terminal display and the run directory; an extra controller actor would add one hop to
every poll and a second thing that can die. Workers are Ray actors and outlive process
groups; the controller only talks to them through its worker group.

States (one small class each, carrying its own data, ``states.py`` beside this file) and one ``_step`` that
moves on::

    Starting ──> Running ──> Finished            Running ──> Stopped (a signal)
                  │  ▲ │
        failure   ▼  │ ▼  capacity returned / a node drains
              Recovering  Resizing
                  │
                  ▼
                Failed

The controller owns its state: it alone changes its fields. Its inputs return intents
(``health.py``: an eviction or a rollback; ``drain.py``: a ``Shrink``; ``stop.py``: the
signal), its decisions come from pure functions (``policies.py``, ``recovery_plan.py``),
and the steps of a re-formation are carried out on the group by ``reform.py``, which
returns what it found. ``worker_group_cls`` is the test seam: controller tests swap in a
scripted fake group and step one transition at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from elastic.agent.rows import COLUMNS
from elastic.checkpoint.committer import CheckpointCommitter
from elastic.control import policies
from elastic.control.callbacks import Callback, checked
from elastic.control.controller.states import (
    Failed,
    Finished,
    Growing,
    Recovering,
    Resizing,
    Running,
    Starting,
    State,
    stopped_state,
)
from elastic.control.drain import DrainWatch, shrink_intent
from elastic.control.gc_pauses import collector_paused
from elastic.control.gcs_watch import GcsWatch
from elastic.control.health import CommitGate, HealthMonitor, Rollback, gate_commits
from elastic.control.outages import Outages
from elastic.control.recovery_plan import Holdings, RestoreChoice, complete_replicas, plan_recovery
from elastic.control.reform import (
    Boundary,
    Reformed,
    choose_restore,
    free_survivors,
    reform,
    release_dead_groups,
    stop_at_boundary,
    survivors_wait_s,
)
from elastic.control.regroup import hsdp_order
from elastic.control.step_events import StepTally, memory_checkpoint_fields, step_fields
from elastic.control.stop import CHECKPOINT_TIMEOUT_S, StopSignals, checked_stop_checkpoint, stop_now_in
from elastic.control.timing import PhaseTimer
from elastic.control.worker_group import WorkerGroup
from elastic.control.worker_group.api import Member, WorkerGroupFactory
from elastic.errors import LOADER_RETRIES, JobFailed, LoaderStalled, WorkerFailure, failure_fields
from elastic.events import EventLog, Recovery, RunResult
from elastic.messages import AnomalyReport, EvalReport, SdcReport, StepReport, StepRows, UploadReport, WorkerReport
from elastic.models.config import token_shape
from elastic.worker.hooks import StepHook

if TYPE_CHECKING:
    from elastic.spec import JobSpec

logger = logging.getLogger(__name__)

# How long a grow-back waits, from its start, for a storage upload in flight (_upload_in_flight).
GROW_WAITS_FOR_UPLOAD_S = 120.0
GCS_LOST = "Ray can no longer place, start or stop this job's workers"


class Controller:
    worker_group_cls: WorkerGroupFactory = WorkerGroup
    gcs_watch_cls: type[GcsWatch] = GcsWatch  # test seam: a scripted GCS loss
    clock = staticmethod(time.monotonic)  # the driver's clock for recovery figures (test seam)

    def __init__(
        self,
        spec: JobSpec,
        events: EventLog,
        corpus_uri: str,
        *,
        callbacks: list[Callback] | None = None,
        step_hook: StepHook | None = None,
        resume: int | None = None,
        storage_uri: str = "",
        stop_signals: StopSignals | None = None,
    ):
        self.spec = spec
        self.events = events
        self.callbacks = checked(callbacks or [])
        self.group = self.worker_group_cls(spec, corpus_uri, step_hook=step_hook, storage_uri=storage_uri)
        self.gcs = self.gcs_watch_cls.of_this_driver()
        committer = CheckpointCommitter(spec, storage_uri, events) if storage_uri else None
        self.committer = gate_commits(committer, spec)  # with SDC checks: verified steps only
        self.resume = resume  # the storage checkpoint step to start from, or None
        self.stop_signals = stop_signals  # set by ElasticTrainer.fit (stop.py)
        self.allowed = spec.allowed_dps()
        self.state: State = Starting()
        self.step = 0  # optimizer steps committed by every rank
        self.failures = 0
        self.dp_history: list[list[int]] = []
        self.losses: dict[int, float] = {}
        self.tokens_per_s: list[float] = []
        self.outages = Outages()
        self._pending: dict[int, StepTally] = {}  # step -> its reports so far
        self._recovered_at_step = 0
        self._loader_stalls: list[float] = []  # the waits of the loader stalls since a step was last trained
        self._evaluated = 0  # the newest step whose eval event was written
        self._last_grow_check = 0.0
        self._growing: Growing | None = None  # a grow-back's new workers, starting while the job trains
        self._base_step = 0  # the step the current generation started from
        self._drain_watch = DrainWatch()
        gate = self.committer if isinstance(self.committer, CommitGate) else None
        self.health = HealthMonitor(spec, events, lambda: self.group.members, self.group.exclude_nodes, gate)

    @property
    def recoveries(self) -> list[Recovery]:
        return self.outages.closed

    # ------------------------------------------------------------------ main loop
    def run(self) -> RunResult:
        t0 = time.time()
        try:
            while not self.state.is_terminal:
                self.state = self._step(self.state)
                if (unwritable := self.events.fault()) is not None and not self.state.is_terminal:
                    self.state = Failed(f"the run directory can no longer be written: {unwritable}")
                if isinstance(self.state, Running):
                    self.state = self._notices(self.state)
                if self._growing is not None and not isinstance(self.state, Running):
                    self._drop_growth()  # a failure, a stop or a drain came first
        except BaseException as exc:  # a second signal, or elastic.stop_grace_s passed (stop.py)
            stop = stop_now_in(exc)
            if stop is None or self.stop_signals is None:
                raise
            if not self.state.is_terminal:  # a signal just after the end keeps the end's result
                self.state = stopped_state(self.stop_signals, self.step, None, stop.reason)
        finally:
            if self.stop_signals is not None:
                self.stop_signals.job_over()  # a signal now would break the shutdown, not stop sooner
            if (gone := self.gcs.lost()) is None:
                self.group.shutdown()
            else:  # its calls would wait for the GCS until Ray ends this process (gcs_watch.py)
                logger.warning("%s: the workers are left to Ray", gone)
            if self.committer is not None:
                self.committer.cut_off(self._base_step, self.step, "its uploads were cut off by the job's end")
                self.committer.close()
        return self._finish(time.time() - t0)

    def _finish(self, wall_s: float) -> RunResult:
        status = getattr(self.state, "status", None) or ("succeeded" if isinstance(self.state, Finished) else "failed")
        reason = getattr(self.state, "reason", None)
        extra = getattr(self.state, "fields", {})
        self.events.emit("job_end", status=status, steps=self.step, **({"reason": reason} if reason else {}), **extra)
        result = RunResult(
            status=status,
            steps=self.step,
            final_loss=self.losses.get(self.step),
            wall_s=wall_s,
            mean_tokens_per_s=sum(self.tokens_per_s) / len(self.tokens_per_s) if self.tokens_per_s else 0.0,
            failures=self.failures,
            dp_history=self.dp_history,
            recoveries=self.recoveries,
            excluded_nodes=self.health.excluded_nodes(),
            checkpoint_failures=list(self.committer.failures) if self.committer is not None else [],
            **({"stop": extra} if status == "stopped" else {}),
        )
        if status == "failed":
            failed = JobFailed(reason or "job failed")
            failed.result = result  # type: ignore[attr-defined]
            raise failed
        return result

    def _step(self, state: State) -> State:
        handler = getattr(self, f"_on_{state.name}")
        try:
            if isinstance(state, Running):
                return handler(state)
            with collector_paused():  # a re-formation: no collector pause on its path (gc_pauses.py)
                return handler(state)
        except WorkerFailure as failure:  # a failure while starting, recovering or resizing
            if isinstance(state, Starting):  # recorded like any failure, so its cause is in events.jsonl too
                return self._start_failed(failure)
            return self._recovering(failure)

    def _start_failed(self, f: WorkerFailure) -> State:
        """A failure while the group starts. The machines' (a node or actor lost, a rendezvous
        that did not form): start again, within ``elastic.max_failures``, keeping the workers
        that answered.
        The training code's own error (``starts_again`` False): a new start would repeat it."""
        self.failures += 1
        self.events.emit("failure", **failure_fields(f))
        if not f.starts_again or self._budget_spent():  # (NotRetryable is a WorkerError: never again)
            return Failed(f"could not start the worker group: {f.cause}: {f.detail}")
        # Whole replicas of members that answered stay for the next try (no new actors to
        # start: at thousands of ranks, minutes); ranks that never answered may be stuck in
        # the old rendezvous, and go, with the rest of their replicas.
        answered = [m for m in self.group.members if not m.dead and m.rank not in f.unanswered]
        whole = {id(m) for r in complete_replicas(answered, self.spec.parallel.replica_size) for m in r}
        if gone := [m for m in self.group.members if not m.dead and id(m) not in whole]:
            self.group.kill(gone)
        release_dead_groups(self.group)
        logger.warning(
            "the worker group did not start (%s: %s): starting again, %d worker(s) kept",
            f.cause, f.detail, len(whole),
        )  # fmt: skip
        return Starting()

    # ------------------------------------------------------------------ starting
    def _on_starting(self, state: Starting) -> State:
        e = self.spec.elastic
        # A start begun again keeps the whole replicas of its last try (``_start_failed``).
        kept = complete_replicas([m for m in self.group.members if not m.dead], self.spec.parallel.replica_size)
        self.group.request_capacity()
        spare = self.group.wait_spare(e.max_dp - len(kept), timeout=min(e.min_dp_wait_s, 10.0))
        dp = policies.target_dp(len(kept) + len(spare), self.allowed)
        if dp is None or dp < e.min_dp:
            spare = self.group.wait_spare(e.min_dp - len(kept), timeout=e.min_dp_wait_s)
            dp = policies.target_dp(len(kept) + len(spare), self.allowed)
        if dp is None:
            return Failed(f"capacity for min_dp={e.min_dp} replicas did not appear within {e.min_dp_wait_s:g}s")
        if surplus := [m for r in kept[dp:] for m in r]:  # fewer replicas allowed than kept
            self.group.kill(surplus)
        kept = kept[:dp]
        members = [m for r in kept for m in r] + (self.group.spawn(spare[: dp - len(kept)]) if dp > len(kept) else [])
        choice = RestoreChoice(self.resume, "storage") if self.resume is not None else RestoreChoice(None, "none")
        reformed = self._re_form(members, dp, 0, choice, [])
        self.step = self._base_step = reformed.result.step
        logger.info("process group init %.3fs for world size %d", reformed.result.init_s, len(members))
        p = self.spec.parallel
        self.events.emit("job_start", dp=dp, tp=p.tp, pp=p.pp, nodes=len({m.node_id for m in members}))
        self.events.emit("placement", **self.group.placement())
        if choice.source == "storage":
            r = reformed.result
            self.events.emit(
                "restore", step=self.step, source="storage", duration_s=r.restore_s, bytes_read=r.restore_bytes_read
            )
        self.dp_history.append([self.step, dp])
        return Running()

    # ------------------------------------------------------------------ running
    def _on_running(self, state: Running) -> State:
        if not state.launched:
            self.group.launch(self.spec.train.steps)
            state.launched = True
        obs = self.group.observe()
        evict: WorkerFailure | None = None
        for rank, result in obs.results:
            evict = self._collect(rank, result) or evict
            if self._budget_spent():
                self.group.request_stop()
                return Failed(
                    f"failure budget exhausted: {self.failures} failures > "
                    f"elastic.max_failures={self.spec.elastic.max_failures}"
                )
        if obs.failure is not None:
            return self._recovering(obs.failure)
        if evict is not None:  # on_straggler / on_sdc: evict
            return self._recovering(evict)
        if obs.finished:
            return self._finished()
        if obs.stopped:  # stopped at a boundary without a resize request: restart the loop
            return Running()
        return self._grow_check() or state

    def _finished(self) -> State:
        """Every step done: finished, unless the final storage checkpoint could not be
        committed (DESIGN §10): the run would then look complete with nothing to resume."""
        if self.committer is None or not self.spec.checkpoint.every_steps:  # no storage tier
            return Finished()
        why = self.committer.final_failure(self.step)
        if why is None:
            return Finished()
        return Failed(f"the final checkpoint (step {self.step}) could not be committed to storage: {why}")

    # ------------------------------------------------------------------ growing back
    def _grow_check(self) -> State | None:
        if self._growing is not None:
            return self._grown()
        now = time.monotonic()
        if now - self._last_grow_check < self.spec.elastic.grow_check_s or self.group.dp >= self.spec.elastic.max_dp:
            return None
        self._last_grow_check = now
        spare = self.group.spare_groups()
        logger.debug("grow check: dp=%d spare=%d", self.group.dp, len(spare))
        decision = policies.scaling_decision(self.group.dp, self.group.dp + len(spare), self.allowed)
        if isinstance(decision, policies.ResizeDecision) and decision.dp > self.group.dp:
            # The new workers start while the job trains on (a worker's start took 3.6-4.9 s
            # of a grow-back's pause here, about 30 s on a loaded host), and the controller
            # keeps watching the job meanwhile (elastic/control/spawning.py). The job then
            # stops at a boundary only for the re-formation.
            groups = spare[: decision.dp - self.group.dp]
            self._growing = Growing(decision.dp, groups, self.group.spawn_begin(groups), now)
            return self._grown()
        return None

    def _grown(self) -> State | None:
        """The grow-back once its new workers have started (or failed to) and the storage
        checkpoint in flight has arrived; None meanwhile."""
        g = self._growing
        assert g is not None
        if self._upload_in_flight() and time.monotonic() - g.started < GROW_WAITS_FOR_UPLOAD_S:
            return None
        try:
            ahead = self.group.spawn_end(g.pending, wait_s=0.0)
        except WorkerFailure as failure:  # met once the job stands at a boundary, as before a start
            self._growing = None
            return Resizing("capacity returned", g.dp, g.groups, not_started=failure)
        if ahead is None:
            return None
        self._growing = None
        took = time.monotonic() - g.started
        logger.info("started %d new worker(s) in %.2fs while the job trained on", len(ahead), took)
        return Resizing("capacity returned", g.dp, g.groups, ahead=ahead)

    def _upload_in_flight(self) -> bool:
        """Is the storage checkpoint of this generation's latest due step still uploading?
        Stopping the job would drop it (``StorageUploader.close``: a re-formation), so a
        grow-back, which can wait, waits for it: seen at ~100M here, where the job stopped
        for a grow-back 6 s into the upload of step 15 and that checkpoint was lost."""
        every = self.spec.checkpoint.every_steps
        if self.committer is None or not every:
            return False
        due = self.step - self.step % every
        return due > self._base_step and not self.committer.settled(due)

    def _drop_growth(self) -> None:
        g, self._growing = self._growing, None
        if g is not None:
            self.group.spawn_cancel(g.pending)

    # ------------------------------------------------------------------ notices: a stop signal, drained nodes
    def _notices(self, state: Running) -> State:
        signals = self.stop_signals
        if signals is not None and signals.requested:
            return self._stop_job(signals)
        if not self._drain_watch.due(time.monotonic()):
            return state
        if (gone := self.gcs.lost()) is not None:  # asked first: the drain poll would wait for it
            return Failed(f"{gone}: {GCS_LOST}")
        try:
            notices = self.group.draining_nodes()
        except Exception as exc:  # noqa: BLE001 - the GCS is busy: look again at the next poll
            logger.debug("reading draining nodes failed: %s", exc)
            return state
        self.group.avoid(set(notices))  # not used to grow back while draining
        if not notices:  # the common case: no O(ranks) look at the members
            return state
        live = [m for m in self.group.members if not m.dead]
        hit = self._drain_watch.hit(notices, {m.node_id for m in live})
        if not hit:
            return state
        off = [
            r for r in complete_replicas(live, self.spec.parallel.replica_size) if not any(m.node_id in hit for m in r)
        ]
        spare = self.group.spare_groups()
        intent = shrink_intent(hit, len(off), len(spare), self.allowed, self._step_time_s(), time.monotonic())
        if intent is None:
            logger.warning(
                "node(s) %s are draining but %d whole replica(s) elsewhere reach no allowed DP (%s): "
                "training goes on there until they leave",
                sorted(hit),
                len(off),
                self.allowed,
            )
            self._drain_watch.give_up(set(hit))
            return state
        logger.warning(
            "node(s) %s are draining (deadline in %s): removing their replicas %s",
            sorted(hit),
            "none" if intent.left_s is None else f"{intent.left_s:.1f}s",
            "at once (too near to finish the step)" if intent.urgent else "at the next step boundary",
        )
        fields = dict(
            drain_reason=intent.reason,
            nodes=sorted(hit),
            deadline_s=None if intent.left_s is None else round(intent.left_s, 3),
            at_once=intent.urgent,
        )
        keep = [m for r in off[: intent.plan.keep] for m in r]
        groups = spare[: intent.plan.grow]
        return Resizing("drain", intent.plan.dp, groups, keep=keep, at_once=intent.urgent, fields=fields)

    # ------------------------------------------------------------------ a graceful stop
    def _stop_job(self, signals: StopSignals) -> State:
        """The first signal: stop every rank after the same step and checkpoint that step."""
        boundary = stop_at_boundary(self.group, self.group.members, signals.remaining_s())
        for rank, result in boundary.reports:
            self._collect(rank, result)
        if boundary.stuck:
            reason = f"the step boundary was not reached within elastic.stop_grace_s={signals.grace_s:g}s"
            return stopped_state(signals, self.step, None, reason)
        signals.past_boundary()
        if boundary.failure is not None:
            return stopped_state(signals, self.step, None, f"a failure while stopping: {boundary.failure.cause}")
        if self.committer is None:
            return stopped_state(signals, self.step, None, "no storage tier (checkpoint.every_steps=0)")
        if self.step == 0:
            return stopped_state(signals, self.step, None, "no step completed yet")
        self.group.save_checkpoints(CHECKPOINT_TIMEOUT_S)
        for rank, result in self.group.drain_results(self.group.members):
            self._collect(rank, result)
        checkpoint_step, reason = checked_stop_checkpoint(self.committer, self.step)
        return stopped_state(signals, self.step, checkpoint_step, reason)

    def _on_finished(self, state: Finished) -> State:
        return state

    def _on_failed(self, state: Failed) -> State:
        return state

    # ------------------------------------------------------------------ re-forming: recovering, resizing
    def _re_form(
        self,
        members: Sequence[Member],
        dp: int,
        step: int,
        choice: RestoreChoice,
        holdings: Sequence[tuple[Member, Holdings | None]],
        timer: PhaseTimer | None = None,
        notify: bool = False,
    ) -> Reformed:
        """Plan and carry out one re-formation; ``notify``: a failure's recovery (callbacks)."""
        timer = timer or PhaseTimer(self.clock, self.clock())

        def before(order: Sequence[Member]) -> None:
            for cb in self.callbacks:
                cb.before_reconfigure(self.failures, self.group, order)

        reformed = reform(self.spec, self.group, members, dp, step, choice, holdings, timer, before if notify else None)
        self.health.new_layout()
        return reformed

    def _absorb(self, reports: Sequence[tuple[int, WorkerReport]]) -> None:
        """Steps that stopping ranks reported on the way out: kept until a plan commits them.
        Their upload reports go to the committer (an upload that finished just before the stop)."""
        for rank, result in reports:
            if isinstance(result, UploadReport):
                if self.committer is not None:
                    self.committer.add(rank, result)
            elif isinstance(result, StepRows) and result.step > self.step:
                self._tally(result.step).add(result)
            elif isinstance(result, StepReport) and result.step > self.step:
                self._tally(result.step).add_report(rank, result)

    def _reformed(self, old_dp: int, reformed: Reformed, reason: str, **resize: Any) -> None:
        """Record a re-formation: the step resumed from, the resize and restore events."""
        dp, choice, result = reformed.plan.dp, reformed.plan.restore, reformed.result
        if self.committer is not None:  # the old generation's uploads still going were dropped
            self.committer.cut_off(self._base_step, self.step, f"its uploads were cut off by a re-formation ({reason})")
        self.step = self._base_step = result.step
        self._pending.clear()
        if dp != old_dp or resize:
            self.events.emit(
                "resize", old_dp=old_dp, new_dp=dp, grad_accum=self.spec.grad_accum(dp), reason=reason, **resize
            )
        if dp != old_dp:
            self.dp_history.append([self.step, dp])
        if choice.source != "none":
            extra = {"bytes_read": result.restore_bytes_read} if choice.source == "storage" else {}
            self.events.emit(
                "restore",
                step=self.step,
                source=choice.source,
                duration_s=result.restore_s,
                breakdown=reformed.breakdown,
                store_ops_per_rank=result.store_ops_per_rank,  # the rendezvous' cost (docs/outputs.md)
                ranks_kept_state=result.ranks_kept_state,
                peer_bytes=result.peer_bytes,
                configure_cpu_s=round(result.cpu_s, 3),
                **extra,
            )
        self.events.emit("placement", **self.group.placement())

    def _on_recovering(self, state: Recovering) -> State:
        """Free the survivors, plan the new layout, re-form it, and record what happened."""
        f = state.failure
        self.failures += 1
        self.outages.failed(f.cause, state.failed_at, state.detected_at)
        self.events.emit("failure", **failure_fields(f))
        logger.warning("failure: %s ranks=%s (%s)", f.cause, f.ranks, f.detail)
        if (gone := self.gcs.lost()) is not None:  # no worker could be placed or started
            return Failed(f"{gone}: {GCS_LOST} (last failure: {f.cause})")
        if not f.retryable:  # a re-formation would meet it again: spend no budget on retries
            return Failed(f"{f.cause} that a retry would repeat: {f.detail}")
        if isinstance(f, LoaderStalled) and (stalled := self._loader_hung(f)) is not None:
            return Failed(stalled)
        if self._budget_spent():
            return Failed(
                f"failure budget exhausted: {self.failures} failures > "
                f"elastic.max_failures={self.spec.elastic.max_failures} (last: {f.cause})"
            )
        group, e = self.group, self.spec.elastic
        timer = PhaseTimer(self.clock, state.detected_at, state.detected_at - state.failed_at)
        timer.mark("decide_s")
        blamed = set(f.ranks) if f.cause != "worker_error" else set()
        culprits = [m for m in group.members if m.rank in blamed]
        nccl = self.spec.resources.device == "cuda"  # shrink in place (docs/architecture.md)
        shrink_unit = self.spec.parallel.replica_size if nccl else None
        wait_s = survivors_wait_s(self._step_time_s(), e.collective_timeout_s, self.spec.resources.device)
        survivors, boundary = free_survivors(group, culprits, wait_s, shrink_unit=shrink_unit)
        if boundary.stuck:
            hung = [m.rank for m in boundary.stuck]
            logger.warning("ranks %s did not leave their step within %.1fs: hung, killed", hung, wait_s)
        self._absorb(boundary.reports)
        replicas = complete_replicas(survivors, self.spec.parallel.replica_size)
        p = self.spec.parallel
        if p.shard_group:  # HSDP: keep whole shard groups first, survivors in place
            replicas = hsdp_order(replicas, lambda m: m.rank, p.shard_group, p.replica_size)
        timer.mark("free_s")
        worker_step = max(state.last_seen_step, self._last_seen_step())  # the culprits' last reports too
        whole = {id(m) for r in replicas for m in r}
        group.kill([m for m in group.members if not m.dead and id(m) not in whole])
        release_dead_groups(group)
        group.request_capacity()
        spare = group.spare_groups()
        decision = plan_recovery(len(replicas), len(spare), self.allowed)
        if decision is None:
            spare = group.wait_spare(e.min_dp - len(replicas), timeout=e.min_dp_wait_s)
            decision = plan_recovery(len(replicas), len(spare), self.allowed)
        if decision is None:
            return Failed(
                f"only {len(replicas)} whole replica(s) left and no capacity for "
                f"min_dp={e.min_dp} within {e.min_dp_wait_s:g}s"
            )
        old_dp = group.dp
        kept = [m for r in replicas[: decision.keep] for m in r]
        group.kill([m for r in replicas[decision.keep :] for m in r])
        timer.mark("decide_s")
        newcomers = group.spawn(spare[: decision.grow]) if decision.grow else []
        timer.mark("spawn_s")
        choice, holdings = choose_restore(self.spec, group, self.committer, kept)
        if choice.source == "memory" and choice.step is not None:
            self._commit_survivors_steps(choice.step)
        reformed = self._re_form(kept + newcomers, decision.dp, 0, choice, holdings, timer, notify=True)
        logger.info("recovery breakdown: %s", reformed.breakdown)
        self._reformed(old_dp, reformed, f.cause)
        self._recovered_at_step = self.step
        self.outages.lost(worker_step - self.step)
        self.outages.reformed(reformed.breakdown, reformed.configured_at)
        return Running()

    def _on_resizing(self, state: Resizing) -> State:
        """A resize without a failure: grow into returned capacity, or shrink around draining
        nodes. At the next step boundary (the leaving workers are alive: their snapshots of
        that step count), or, for a drain too near its deadline, at once."""
        group, timeout = self.group, self.spec.elastic.collective_timeout_s + 5
        ahead, not_started = state.ahead, state.not_started  # a grow-back's, started as the job trained
        started = time.monotonic()
        timer = PhaseTimer(self.clock, self.clock())
        keep = {id(m) for m in (state.keep if state.keep is not None else group.members)}
        kept = [m for m in group.members if id(m) in keep]
        leaving = [m for m in group.members if id(m) not in keep]
        if state.at_once:
            _, boundary = free_survivors(group, leaving, timeout, stop=True)
            if boundary.stuck:
                ranks = [m.rank for m in boundary.stuck]
                return self._recovering(WorkerFailure("workers did not stop after a drain", ranks=ranks))
            self._absorb(boundary.reports)
            last_seen, holders = self._last_seen_step(), kept
        else:
            if (recovering := self._at_boundary(stop_at_boundary(group, group.members, timeout))) is not None:
                group.kill(ahead)  # not members yet: the recovery plans its own
                return recovering
            if not_started is not None:  # met now that the job stands at a boundary, as if started here
                raise not_started
            last_seen, holders = self.step, [m for m in group.members if not m.dead]
        stopped = time.monotonic()
        timer.mark("free_s")
        newcomers = ahead or (group.spawn(state.groups) if state.groups else [])
        timer.mark("spawn_s")
        choice, holdings = choose_restore(self.spec, group, self.committer, holders)
        if choice.source == "memory" and choice.step is not None:
            self._commit_survivors_steps(choice.step)
        old_dp = group.dp
        reformed = self._re_form(kept + newcomers, state.dp, 0 if state.at_once else self.step, choice, holdings, timer)
        if leaving:
            group.kill(leaving)
            for pg in {id(m.group): m.group for m in leaving}.values():
                group.release_group(pg)
            group.request_capacity()
        fields = dict(state.fields)
        if state.reason == "drain":
            fields.update(
                lost_steps=max(0, last_seen - reformed.result.step),
                reform_s=round(time.monotonic() - started, 3),
                stop_s=round(stopped - started, 3),  # of which: until every rank left the step (and was collected)
            )
        self._reformed(old_dp, reformed, state.reason, **fields)
        logger.info("resized from dp=%d to dp=%d in %.2fs", old_dp, state.dp, time.monotonic() - started)
        return Running()

    def _at_boundary(self, boundary: Boundary) -> State | None:
        """Collect what stopping ranks reported; a recovery when some did not stop or failed."""
        evict = None
        for rank, result in boundary.reports:
            evict = self._collect(rank, result) or evict
        if boundary.stuck or boundary.failure is not None:
            ranks = [m.rank for m in boundary.stuck]
            return self._recovering(
                boundary.failure or WorkerFailure("workers did not stop at a step boundary", ranks=ranks)
            )
        return self._recovering(evict) if evict is not None else None

    # ------------------------------------------------------------------ step accounting: reports, commits, rollbacks
    def _collect(self, rank: int, result: WorkerReport | StepRows) -> WorkerFailure | None:
        """One report from a rank; returns an eviction a health policy asks for."""
        if isinstance(result, UploadReport):  # storage tier: a rank's part of a checkpoint (may trail its step)
            if self.committer is not None:
                self.committer.add(rank, result)
            return None
        if isinstance(result, AnomalyReport):
            self._on_anomaly(rank, result)
            return None
        if isinstance(result, EvalReport):
            self._on_eval(result)
            return None
        if isinstance(result, SdcReport):
            rollback, evict = self.health.on_sdc(rank, result)
            if rollback is not None:
                self._roll_back(rollback)
            return evict
        if isinstance(result, StepRows):
            return self._collect_rows(result)
        if self.health.stale(rank) or result.step <= self.step:
            return None  # a replay after a rollback: already committed
        tally = self._tally(result.step)
        tally.add_report(rank, result)
        return self._commit_if_complete(tally)

    def _collect_rows(self, rows: StepRows) -> WorkerFailure | None:
        """A block of step reports from the agents: many ranks' reports of one step."""
        if rows.step <= self.step:
            return None  # a replay after a rollback: already committed
        stale = self.health.stale_ranks()
        if stale:  # reports of ranks from before an SDC rollback they have not announced yet
            keep = ~np.isin(rows.ranks, list(stale))
            rows = StepRows(step=rows.step, **{k: getattr(rows, k)[keep] for k in COLUMNS})
        tally = self._tally(rows.step)
        tally.add(rows)
        return self._commit_if_complete(tally)

    def _tally(self, step: int) -> StepTally:
        tally = self._pending.get(step)
        if tally is None:
            tally = self._pending[step] = StepTally(step, len(self.group.members))
        return tally

    def _commit_if_complete(self, tally: StepTally) -> WorkerFailure | None:
        if not tally.complete:
            return None
        evict = None
        # Every rank finished this step, so each finished the ones before it: a step still
        # short of reports lost some on the way (an agent replaced mid-step) and is committed
        # with those that came.
        for earlier in sorted(s for s in self._pending if s < tally.step):
            evict = self._commit_step(earlier, self._pending.pop(earlier)) or evict
        return self._commit_step(tally.step, self._pending.pop(tally.step)) or evict

    def _commit_survivors_steps(self, upto: int) -> None:
        """After a failure: commit the steps up to ``upto`` that survivors completed.

        A step's last collective precedes its optimizer update, so if any survivor finished
        step s, every rank (the lost ones too) took part in all of it: its loss is the
        global one and the survivors' snapshots of it are consistent.
        """
        for step in sorted(s for s in self._pending if self.step < s <= upto):
            self._commit_step(step, self._pending.pop(step))

    def _commit_step(self, step: int, tally: StepTally) -> WorkerFailure | None:
        rows = tally.rows()
        if not len(rows.ranks):
            return None
        fields = step_fields(self.spec, self.group.dp, step, rows)
        self.step = step
        self.losses[step] = fields["loss"]
        self.tokens_per_s.append(fields["tokens_per_s"])
        self.events.emit("step", ts=float(rows.done_at.max()), **fields)
        evict = self.health.on_step(step, rows)
        snapshot = memory_checkpoint_fields(rows)
        if snapshot is not None:
            self.events.emit("checkpoint", **snapshot)
        if step >= self.spec.train.steps and self.committer is not None:
            self.committer.join()  # the last step: its checkpoint must be committed before job_end
        if step > self._recovered_at_step:
            self.outages.first_step(self.clock())
        self._loader_stalls = []  # a step trained: the loaders delivered
        for cb in self.callbacks:
            cb.after_step(step, self.group)
        return evict

    def _on_eval(self, result: EvalReport) -> None:
        """The eval loss after a step: every rank reports the same value; the first to
        arrive is recorded, once per step (a step trained again after a recovery is not)."""
        if result.step <= self._evaluated:
            return
        self._evaluated = result.step
        self.events.emit("eval", step=result.step, eval_loss=result.eval_loss, duration_s=result.duration_s,
                         rows=result.rows)  # fmt: skip

    def _on_anomaly(self, rank: int, result: AnomalyReport) -> None:
        """NaN/spike: every rank rolled back in place; record it once (from rank 0)."""
        if rank != 0:
            return
        self.failures += 1
        self.events.emit(
            "failure",
            cause=result.cause,
            ranks=list(range(len(self.group.members))),
            nodes=[],
            detail=f"step {result.step} loss {result.loss}: rolled back to step {result.restored_step}, "
            f"{result.action} batch {result.batch_index}",
        )
        self.events.emit("restore", step=result.restored_step, source="memory", duration_s=0.0)
        lost = max(0, result.step - 1 - result.restored_step)
        # Rolled back inside the step on the workers: the group never stopped or changed
        # size, so there is no pause for the driver to time; the cost is the steps redone.
        self.outages.record(Recovery(cause=result.cause, detect_s=0.0, recover_s=0.0, downtime_s=0.0, lost_steps=lost))
        self.step = min(self.step, result.restored_step)

    def _roll_back(self, rollback: Rollback) -> None:
        """An SDC repair: every rank went back to ``rollback.to_step``; the steps after it are redone."""
        self.step = min(self.step, rollback.to_step)
        for step in [s for s in self._pending if s > rollback.to_step]:
            del self._pending[step]
        self.outages.record(rollback.recovery)
        if rollback.counts:
            self.failures += 1

    def _last_seen_step(self) -> int:
        """The newest step any worker reported completing: each worker's own step counter
        (from its last poll answer) and the per-step results received but not committed."""
        return max([self.step] + [m.step for m in self.group.members] + list(self._pending))

    def _step_time_s(self) -> float:
        """The last committed step's time (1 s before the first)."""
        if not self.tokens_per_s or self.tokens_per_s[-1] <= 0:
            return 1.0
        return self.spec.train.global_batch * token_shape(self.spec.model)[0] / self.tokens_per_s[-1]

    def _loader_hung(self, f: LoaderStalled) -> str | None:
        """A data loader that stalled again with no step trained since its last stall: the
        reason the job ends (one bound for it, ``LOADER_RETRIES``), or None to re-form once more."""
        waits = self._loader_stalls
        waits.append(f.waited_s)
        if len(waits) <= LOADER_RETRIES:
            return None
        return (
            f"the data loader hung: {len(waits)} stalls in a row after step {self.step}, no step trained between, "
            f"{sum(waits):g}s waited in all; the last: {f.detail}"
        )

    def _budget_spent(self) -> bool:
        decision = policies.failure_decision(self.failures, self.spec.elastic.max_failures)
        return decision is policies.FailureDecision.RAISE

    def _recovering(self, failure: WorkerFailure) -> Recovering:
        now = self.clock()
        return Recovering(failure, now, self._last_seen_step(), self._failed_at(failure, now))

    def _failed_at(self, f: WorkerFailure, detected_at: float) -> float:
        """The failure time the driver can measure on its own clock: the last time it heard
        from a culprit (a poll answer; ``worker_group.POLL_INTERVAL_S`` apart). The worker
        died after that answer, so the true moment is at most one poll interval later (or,
        for a reply in flight, a few ms earlier). Without culprits (a hang found by the
        collective timeout), the detection time."""
        culprits = set(f.ranks)
        seen = [m.last_ok for m in self.group.members if m.rank in culprits]
        return min(detected_at, max(seen)) if seen else detected_at
