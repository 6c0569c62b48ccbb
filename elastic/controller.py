"""The elastic controller: an explicit state machine that drives a run.

Where it runs: in the driver process (the process of ``elastic run``, of the Python API,
or of a ``ray job submit`` entrypoint). The driver already owns the run's lifetime, the
terminal display and the run directory; an extra controller actor would add one hop to
every poll and a second thing that can die. Workers are Ray actors and outlive process
groups; the controller only talks to them through ``WorkerGroup``.

States (one small class each, carrying its own data) and one ``_step`` that moves on::

    Starting ──> Running ──> Finished
                  │  ▲ │
        failure   ▼  │ ▼  capacity returned
              Recovering  Resizing
                  │
                  ▼
                Failed

Decisions come from the pure functions in ``elastic.policies``; this module carries them
out and writes the events. ``worker_group_cls`` is the test seam: controller tests swap in
a scripted fake group and step one transition at a time.

Longer than the ~350 lines we aim for: the state machine's handlers are kept together so that
a recovery reads top to bottom in one file; the states are in ``elastic/states.py``, the
decisions in ``elastic/policies.py`` and ``elastic/recovery_plan.py``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from elastic import notices, policies
from elastic import recovery_plan as plan
from elastic.checkpoint.committer import CheckpointCommitter
from elastic.errors import JobFailed, WorkerFailure
from elastic.events import EventLog, Recovery, RunResult
from elastic.health import HealthMonitor, gate_commits
from elastic.messages import AnomalyReport, SdcReport, StepReport, UploadReport, WorkerReport
from elastic.recovery_timing import PhaseTimer
from elastic.states import Failed, Finished, Recovering, Resizing, Running, Starting, State
from elastic.stop import StopSignals, stop_now_in, stopped_state
from elastic.worker.hooks import StepHook
from elastic.worker_group import WorkerGroup
from elastic.worker_group_api import WorkerGroupAPI

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- controller


class Controller:
    worker_group_cls: type[WorkerGroupAPI] = WorkerGroup
    clock = staticmethod(time.monotonic)  # the driver's clock for recovery figures (test seam)
    stop_signals: StopSignals | None = None  # set by ElasticTrainer.fit (elastic/stop.py)

    def __init__(
        self,
        spec: Any,
        events: EventLog,
        corpus_uri: str,
        *,
        callbacks: list[Any] | None = None,
        step_hook: StepHook | None = None,
        resume: dict[str, Any] | None = None,
        storage_uri: str = "",
    ):
        self.spec = spec
        self.events = events
        self.callbacks = list(callbacks or [])
        self.group = self.worker_group_cls(spec, corpus_uri, step_hook=step_hook, storage_uri=storage_uri)
        # The storage tier's commits (its store is opened on first use).
        self.committer = CheckpointCommitter(spec, storage_uri, events) if storage_uri else None
        self.committer = gate_commits(self.committer, spec)  # with SDC checks: verified steps only
        self.resume = resume  # {"step": N} from the storage tier, or None
        self.allowed = spec.allowed_dps()
        self.state: State = Starting()
        self.step = 0  # optimizer steps committed by every rank
        self.failures = 0
        self._recovered_at_step = 0
        self.dp_history: list[list[int]] = []
        self.recoveries: list[Recovery] = []
        self.losses: dict[int, float] = {}
        self.tokens_per_s: list[float] = []
        self._pending: dict[int, dict[int, StepReport]] = {}  # step -> rank -> report
        self._pending_recoveries: list[dict[str, Any]] = []  # recovered, waiting for the first step
        self._last_grow_check = 0.0
        self.health = HealthMonitor(self)  # stragglers, lemon nodes, SDC (docs/health.md)

    # ------------------------------------------------------------------ main loop
    def run(self) -> RunResult:
        t0 = time.time()
        try:
            while not self.state.is_terminal:
                self.state = self._step(self.state)
                if isinstance(self.state, Running):  # stop and drain notices (elastic/stop.py, elastic/drain.py)
                    self.state = notices.act(self, self.state)
        except BaseException as exc:  # a second signal, or elastic.stop_grace_s passed (elastic/stop.py)
            stop = stop_now_in(exc)
            if stop is None:
                raise
            self.state = stopped_state(self.stop_signals, self.step, None, stop.reason)
        finally:
            self.group.shutdown()
        status = getattr(self.state, "status", None) or ("succeeded" if isinstance(self.state, Finished) else "failed")
        reason = getattr(self.state, "reason", None)
        extra = getattr(self.state, "fields", {})
        self.events.emit("job_end", status=status, steps=self.step, **({"reason": reason} if reason else {}), **extra)
        result = RunResult(
            status=status,
            steps=self.step,
            final_loss=self.losses.get(self.step),
            wall_s=time.time() - t0,
            mean_tokens_per_s=sum(self.tokens_per_s) / len(self.tokens_per_s) if self.tokens_per_s else 0.0,
            failures=self.failures,
            dp_history=self.dp_history,
            recoveries=self.recoveries,
            excluded_nodes=self.health.excluded_nodes(),
            **({"stop": extra} if status == "stopped" else {}),
        )
        if status == "failed":
            raise _attach(JobFailed(reason or "job failed"), result)
        return result

    def _step(self, state: State) -> State:
        handler = getattr(self, f"_on_{state.name}")
        try:
            return handler(state)
        except WorkerFailure as failure:  # a failure while recovering or resizing: recover again
            if isinstance(state, Recovering):
                self._pending_recoveries.append(
                    self._pending_entry(state, max(state.last_seen_step, self._last_seen_step()) - self.step)
                )
            if isinstance(state, Starting):
                return Failed(f"could not start the worker group: {failure.cause}: {failure.detail}")
            return self._recovering(failure)

    # ------------------------------------------------------------------ starting
    def _on_starting(self, state: Starting) -> State:
        e = self.spec.elastic
        self.group.request_capacity()
        spare = self.group.wait_spare(e.max_dp, timeout=min(e.min_dp_wait_s, 10.0))
        dp = policies.target_dp(len(spare), self.allowed)
        if dp is None or dp < e.min_dp:
            spare = self.group.wait_spare(e.min_dp, timeout=e.min_dp_wait_s)
            dp = policies.target_dp(len(spare), self.allowed)
        if dp is None:
            return Failed(f"capacity for min_dp={e.min_dp} replicas did not appear within {e.min_dp_wait_s:g}s")
        members = self.group.spawn(spare[:dp])
        if self.resume is not None:
            t = self.group.configure(members, dp, self.resume["step"], self.resume["step"], "storage")
        else:
            t = self.group.configure(members, dp, 0, None, "none")
        source = "storage" if self.resume is not None else None
        self.step = t["step"]
        logger.info("process group init %.3fs for world size %d", t["init_s"], len(members))
        self.events.emit(
            "job_start",
            dp=dp,
            tp=self.spec.parallel.tp,
            pp=self.spec.parallel.pp,
            nodes=len({m.node_id for m in members}),
        )
        self.events.emit("placement", **self.group.placement())
        if source == "storage":
            self.events.emit(
                "restore",
                step=self.step,
                source="storage",
                duration_s=t["restore_s"],
                bytes_read=t.get("restore_bytes_read", 0),
            )
        self.dp_history.append([self.step, dp])
        return Running()

    # ------------------------------------------------------------------ running
    def _on_running(self, state: Running) -> State:
        if not state.launched:
            self.group.launch(self.spec.train.steps)
            state.launched = True
        obs = self.group.observe()
        try:
            for rank, result in obs.results:
                self._collect(rank, result)
        except _BudgetExhausted:
            return Failed(
                f"failure budget exhausted: {self.failures} failures > "
                f"elastic.max_failures={self.spec.elastic.max_failures}"
            )
        if obs.failure is not None:
            return self._recovering(obs.failure)
        if (evict := self.health.take_failure()) is not None:  # on_straggler / on_sdc: evict
            return self._recovering(evict)
        if obs.finished:
            return Finished()
        if obs.stopped:  # stopped at a boundary without a resize request: restart the loop
            return Running()
        grow = self._grow_check()
        return grow or state

    def _collect(self, rank: int, result: WorkerReport) -> None:
        if isinstance(result, UploadReport):  # storage tier: a rank's part of a checkpoint (may trail its step)
            if self.committer is not None:
                self.committer.add(rank, result)
            return
        if isinstance(result, AnomalyReport):
            self._on_anomaly(rank, result)
            return
        if isinstance(result, SdcReport) or self.health.stale(rank):
            return self.health.on_sdc(rank, result) if isinstance(result, SdcReport) else None
        step = result.step
        if step <= self.step:
            return  # a replay after a rollback: already committed
        per_step = self._pending.setdefault(step, {})
        per_step[rank] = result
        if len(per_step) == len(self.group.members):
            self._commit_step(step, self._pending.pop(step))

    def _commit_survivors_steps(self, upto: int) -> None:
        """After a failure: commit the steps up to ``upto`` that survivors completed.

        A step's last collective precedes its optimizer update, so if any survivor finished
        step s, every rank (the lost ones too) took part in all of it: its loss is the
        global one and the survivors' snapshots of it are consistent.
        """
        for step in sorted(s for s in self._pending if self.step < s <= upto):
            self._commit_step(step, self._pending.pop(step))

    def _commit_step(self, step: int, results: dict[int, StepReport]) -> None:
        r0 = results[min(results)]
        dp, tp, pp = self.group.dp, self.spec.parallel.tp, self.spec.parallel.pp
        step_time = max(r.step_time_s for r in results.values())
        tokens = self.spec.train.global_batch * self.spec.model.seq_len
        tps = tokens / step_time if step_time > 0 else 0.0
        self.step = step
        self.losses[step] = r0.loss
        self.tokens_per_s.append(tps)
        fields = dict(
            step=step,
            loss=r0.loss,
            dp=dp,
            tp=tp,
            pp=pp,
            grad_accum=self.spec.grad_accum(dp),
            world_size=dp * self.spec.parallel.replica_size,
            step_time_s=step_time,
            tokens_per_s=tps,
            peak_mem_bytes=max(r.peak_mem_bytes for r in results.values()),
            grad_norm=r0.grad_norm,  # pre-clip global gradient norm (identical on every rank)
            data_wait_s=max(r.data_wait_s for r in results.values()),
            compute_s=max(r.compute_s for r in results.values()),
        )
        if r0.mfu is not None:
            fields["mfu"] = r0.mfu
        self.events.emit("step", ts=max(r.done_at for r in results.values()), **fields)
        self.health.on_step(step, results)
        snaps = [r.snapshot for r in results.values() if r.snapshot is not None]
        if snaps:
            self.events.emit(
                "checkpoint",
                step=snaps[0].step,
                tier="memory",
                blocking_s=max(s.blocking_s for s in snaps),
                duration_s=max(s.duration_s for s in snaps),
                bytes=sum(s.bytes for s in snaps),
            )
        if step >= self.spec.train.steps and self.committer is not None:
            self.committer.join()  # the last step: its checkpoint must be committed before job_end
        if self._pending_recoveries and step > self._recovered_at_step:
            self._finish_recoveries()
        for cb in self.callbacks:
            if hasattr(cb, "on_step"):
                cb.on_step(step, self.group)

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
        self.recoveries.append(
            Recovery(cause=result.cause, detect_s=0.0, recover_s=0.0, downtime_s=0.0, lost_steps=lost)
        )
        self.step = min(self.step, result.restored_step)
        if policies.failure_decision(self.failures, self.spec.elastic.max_failures) is policies.FailureDecision.RAISE:
            self.group.request_stop()
            raise _BudgetExhausted()

    def _last_seen_step(self) -> int:
        """The newest step any worker reported completing: each worker's own step counter
        (from its last poll answer) and the per-step results received but not committed."""
        return max([self.step] + [m.step for m in self.group.members] + list(self._pending))

    def _recovering(self, failure: WorkerFailure) -> Recovering:
        now = self.clock()
        return Recovering(failure, now, self._last_seen_step(), self._failed_at(failure, now))

    def _failed_at(self, f: WorkerFailure, detected_at: float) -> float:
        """The failure time the driver can measure on its own clock: the last time it heard
        from a culprit (a poll answer; ``worker_group.POLL_INTERVAL_S`` apart). The worker died
        after that answer, so the true moment is at most
        one poll interval later (or, for a reply in flight, a few ms earlier). Without
        culprits (a hang found by the collective timeout), the detection time."""
        seen = [m.last_ok for m in self.group.members if m.rank in f.ranks]
        return min(detected_at, max(seen)) if seen else detected_at

    def _pending_entry(self, state: Recovering, lost_steps: int) -> dict[str, Any]:
        return {
            "cause": state.failure.cause,
            "failed_at": state.failed_at,
            "detected_at": state.detected_at,
            "detect_s": max(0.0, state.detected_at - state.failed_at),
            "lost_steps": max(0, lost_steps),
        }

    # ------------------------------------------------------------------ recovering
    def _on_recovering(self, state: Recovering) -> State:
        """Free the survivors, plan the new layout, re-form it, and record what happened."""
        f = state.failure
        self.failures += 1
        self.events.emit("failure", cause=f.cause, ranks=f.ranks, nodes=f.nodes, detail=f.detail)
        logger.warning("failure: %s ranks=%s (%s)", f.cause, f.ranks, f.detail)
        if policies.failure_decision(self.failures, self.spec.elastic.max_failures) is policies.FailureDecision.RAISE:
            return Failed(
                f"failure budget exhausted: {self.failures} failures > "
                f"elastic.max_failures={self.spec.elastic.max_failures} (last: {f.cause})"
            )
        group, e = self.group, self.spec.elastic
        timer = PhaseTimer(self.clock, state.detected_at, state.detected_at - state.failed_at)
        timer.mark("decide_s")
        replicas = group.complete_replicas(self._free_survivors(f))
        timer.mark("free_s")
        # The newest step any worker completed (the culprits' last reports included).
        worker_step = max(state.last_seen_step, self._last_seen_step())
        group.kill([m for m in group.members if not m.dead and not any(m in r for r in replicas)])
        self._release_dead_groups()
        group.request_capacity()
        # Plan.
        spare = group.spare_groups()
        recovery = plan.plan_recovery(len(replicas), len(spare), self.allowed)
        if recovery is None:
            spare = group.wait_spare(e.min_dp - len(replicas), timeout=e.min_dp_wait_s)
            recovery = plan.plan_recovery(len(replicas), len(spare), self.allowed)
        if recovery is None:
            return Failed(
                f"only {len(replicas)} whole replica(s) left and no capacity for "
                f"min_dp={e.min_dp} within {e.min_dp_wait_s:g}s"
            )
        # Execute.
        old_dp = group.dp
        kept = [m for r in replicas[: recovery.keep] for m in r]
        group.kill([m for r in replicas[recovery.keep :] for m in r])
        timer.mark("decide_s")
        newcomers = group.spawn(spare[: recovery.grow]) if recovery.grow else []
        timer.mark("spawn_s")
        restore_step, source = self._restore_source(kept)
        members = group.rank_order(kept + newcomers)
        for cb in self.callbacks:
            if hasattr(cb, "on_reconfigure"):
                cb.on_reconfigure(self.failures, group, members)
        timer.mark("decide_s")
        t = group.configure(members, recovery.dp, restore_step or 0, restore_step, source)
        configured_at = timer.configured(t)
        breakdown = timer.rounded()
        logger.info("recovery breakdown: %s", breakdown)
        # Record.
        self.step = t["step"]
        self._pending.clear()
        self._emit_reformed(old_dp, recovery.dp, f.cause, source, t, breakdown)
        self.events.emit("placement", **self.group.placement())
        self._recovered_at_step = self.step
        for p in self._pending_recoveries:  # a recovery interrupted by this failure lost nothing more
            p.setdefault("lost_steps", 0)
        entry = self._pending_entry(state, worker_step - self.step)
        entry.update(breakdown=breakdown, configured_at=configured_at)
        self._pending_recoveries.append(entry)
        return Running()

    def _free_survivors(self, f: WorkerFailure) -> list[Any]:
        """Kill the culprits, wait for the others to leave ``run()`` (killing those that
        cannot), and collect the steps they finished meanwhile. Returns the survivors."""
        group = self.group
        culprits = [m for m in group.members if m.rank in f.ranks and f.cause != "worker_error"]
        group.kill(culprits)
        survivors = [m for m in group.members if m not in culprits and not m.dead]
        stuck = group.wait_runs(survivors, timeout=self.spec.elastic.collective_timeout_s + 5)
        group.kill(stuck)
        survivors = [m for m in survivors if m not in stuck]
        for rank, result in group.drain_results(survivors):
            if isinstance(result, StepReport) and result.step > self.step:
                self._pending.setdefault(result.step, {})[rank] = result
        return survivors

    def _release_dead_groups(self) -> None:
        group = self.group
        for m in group.members:
            if m.dead and all(o.group is not m.group or o.dead for o in group.members):
                group.release_group(m.group)

    def _restore_source(self, kept: list[Any]) -> tuple[int | None, str]:
        """The newest step the kept members' snapshots cover, else the newest checkpoint."""
        step = self.group.common_snapshot_step(kept)
        if step is not None:
            self._commit_survivors_steps(step)
            return step, "memory"
        if self.committer is not None:
            self.committer.join(timeout=60.0)  # a commit in flight may be the newest checkpoint
            from elastic.checkpoint.restore import latest_storage_step

            step = latest_storage_step(self.spec, self.group.storage_uri)
            if step is not None:
                return step, "storage"
        logger.warning("no snapshot in memory or storage covers the lost shards: training restarts from step 0")
        return None, "none"

    def _emit_reformed(
        self, old_dp: int, dp: int, reason: str, source: str, t: dict[str, Any], breakdown: dict[str, float]
    ) -> None:
        if dp != old_dp:
            self.events.emit("resize", old_dp=old_dp, new_dp=dp, grad_accum=self.spec.grad_accum(dp), reason=reason)
            self.dp_history.append([self.step, dp])
        if source != "none":
            extra = {"bytes_read": t.get("restore_bytes_read", 0)} if source == "storage" else {}
            self.events.emit(
                "restore", step=self.step, source=source, duration_s=t["restore_s"], breakdown=breakdown, **extra
            )

    def _finish_recoveries(self) -> None:
        """The first step at the new size is done (its results from every rank reached the
        driver): close every recovery that led here, timed on the driver's clock."""
        now = self.clock()
        for p in self._pending_recoveries:
            breakdown = dict(p.get("breakdown", {}))
            if "configured_at" in p:
                breakdown["first_step_s"] = round(max(0.0, now - p["configured_at"]), 3)
            self.recoveries.append(
                Recovery(
                    cause=p["cause"],
                    detect_s=round(p["detect_s"], 3),
                    recover_s=round(now - p["detected_at"], 3),
                    downtime_s=round(now - p["failed_at"], 3),
                    lost_steps=p["lost_steps"],
                    breakdown=breakdown,
                )
            )
        self._pending_recoveries = []

    # ------------------------------------------------------------------ growing back
    def _grow_check(self) -> State | None:
        now = time.monotonic()
        if now - self._last_grow_check < self.spec.elastic.grow_check_s or self.group.dp >= self.spec.elastic.max_dp:
            return None
        self._last_grow_check = now
        spare = self.group.spare_groups()
        logger.debug("grow check: dp=%d spare=%d", self.group.dp, len(spare))
        decision = policies.scaling_decision(self.group.dp, self.group.dp + len(spare), self.allowed)
        if isinstance(decision, policies.ResizeDecision) and decision.dp > self.group.dp:
            return Resizing("capacity returned", spare[: decision.dp - self.group.dp])
        return None

    def _on_resizing(self, state: Resizing) -> State:
        group = self.group
        group.request_stop()
        stuck = group.wait_runs(group.members, timeout=self.spec.elastic.collective_timeout_s + 5)
        obs = group.observe(timeout=0)
        for rank, result in obs.results:
            self._collect(rank, result)
        if stuck or obs.failure is not None:
            failure = obs.failure or WorkerFailure(
                "workers did not stop at a step boundary", ranks=[m.rank for m in stuck]
            )
            return self._recovering(failure)
        t_start = time.monotonic()
        timer = PhaseTimer(self.clock, self.clock())
        old_dp = group.dp
        newcomers = group.spawn(state.groups)
        timer.mark("spawn_s")
        dp = old_dp + len(state.groups)
        restore_step = group.common_snapshot_step(group.members)
        if restore_step != self.step:
            logger.warning("newest common snapshot is step %s, live step %s", restore_step, self.step)
        timer.mark("decide_s")
        t = group.configure(list(group.members) + newcomers, dp, self.step, restore_step, "memory")
        timer.configured(t)
        self.step = t["step"]
        self._pending.clear()
        self.events.emit("resize", old_dp=old_dp, new_dp=dp, grad_accum=self.spec.grad_accum(dp), reason=state.reason)
        self.events.emit(
            "restore", step=self.step, source="memory", duration_s=t["restore_s"], breakdown=timer.rounded()
        )
        self.dp_history.append([self.step, dp])
        self.events.emit("placement", **self.group.placement())
        logger.info("grew from dp=%d to dp=%d in %.2fs", old_dp, dp, time.monotonic() - t_start)
        return Running()

    def _on_finished(self, state: Finished) -> State:
        return state

    def _on_failed(self, state: Failed) -> State:
        return state


class _BudgetExhausted(Exception):
    pass


def _attach(exc: JobFailed, result: RunResult) -> JobFailed:
    exc.result = result  # type: ignore[attr-defined]
    return exc
