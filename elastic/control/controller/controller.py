"""The elastic controller's state machine: the main loop, starting, running, growing back,
the notices it acts on (a stop signal, drained nodes) and a graceful stop.

Where it runs: in the driver process (the process of ``elastic run``, of the Python API,
or of a ``ray job submit`` entrypoint). The driver already owns the run's lifetime, the
terminal display and the run directory; an extra controller actor would add one hop to
every poll and a second thing that can die. Workers are Ray actors and outlive process
groups; the controller only talks to them through its worker group.

States (one small class each, carrying its own data, ``states.py``) and one ``_step`` that
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
from typing import TYPE_CHECKING

from elastic.checkpoint.committer import CheckpointCommitter
from elastic.control import policies
from elastic.control.callbacks import Callback, checked
from elastic.control.controller.reforms import Reformations
from elastic.control.drain import DrainWatch, shrink_intent
from elastic.control.gc_pauses import collector_paused
from elastic.control.health import CommitGate, HealthMonitor, gate_commits
from elastic.control.outages import Outages
from elastic.control.recovery_plan import RestoreChoice, complete_replicas
from elastic.control.reform import release_dead_groups, stop_at_boundary
from elastic.control.controller.states import Failed, Finished, Growing, Resizing, Running, Starting, State
from elastic.control.step_events import StepTally
from elastic.control.stop import CHECKPOINT_TIMEOUT_S, StopSignals, checked_stop_checkpoint, stop_now_in, stopped_state
from elastic.control.worker_group import WorkerGroup
from elastic.control.worker_group_api import WorkerGroupFactory
from elastic.errors import JobFailed, WorkerFailure, failure_fields
from elastic.events import EventLog, Recovery, RunResult
from elastic.worker.hooks import StepHook

if TYPE_CHECKING:
    from elastic.spec import JobSpec

logger = logging.getLogger(__name__)

# How long a grow-back waits, from its start, for a storage upload in flight (_upload_in_flight).
GROW_WAITS_FOR_UPLOAD_S = 120.0


class Controller(Reformations):
    worker_group_cls: WorkerGroupFactory = WorkerGroup
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
            self.group.shutdown()
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
