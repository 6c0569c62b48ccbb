"""The controller's re-formations: recovering from a failure and resizing without one
(capacity returned, nodes draining). A part of the ``Controller`` class (a mixin of it,
split out by concern); the steps on the worker group are carried out by
``elastic/control/reform.py``, which returns what it found, and only this class changes
the controller's fields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from elastic.control.controller.steps import StepAccounting
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
from elastic.control.controller.states import Failed, Recovering, Resizing, Running, State
from elastic.control.timing import PhaseTimer
from elastic.control.worker_group_api import Member
from elastic.errors import WorkerFailure, failure_fields
from elastic.messages import StepReport, StepRows, UploadReport, WorkerReport

logger = logging.getLogger(__name__)


class Reformations(StepAccounting):
    # ------------------------------------------------------------------ re-forming
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
        if not f.retryable:  # a re-formation would meet it again: spend no budget on retries
            return Failed(f"{f.cause} that a retry would repeat: {f.detail}")
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
