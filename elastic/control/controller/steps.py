"""The controller's step accounting: the reports ranks send, the steps they commit, and the
rollbacks done in place (NaN, spike, SDC). A part of the ``Controller`` class (a mixin of
it, split out by concern); it changes only the controller's own fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from elastic.agent.rows import COLUMNS
from elastic.control import policies
from elastic.control.health import Rollback
from elastic.control.controller.states import Recovering
from elastic.control.step_events import StepTally, memory_checkpoint_fields, step_fields
from elastic.errors import WorkerFailure
from elastic.events import EventLog, Recovery
from elastic.messages import AnomalyReport, SdcReport, StepRows, UploadReport, WorkerReport
from elastic.models.config import token_shape

if TYPE_CHECKING:
    from elastic.checkpoint.committer import CheckpointCommitter
    from elastic.control.callbacks import Callback
    from elastic.control.health import CommitGate, HealthMonitor
    from elastic.control.outages import Outages
    from elastic.control.worker_group_api import WorkerGroupAPI
    from elastic.spec import JobSpec


class ControllerFields:
    """The controller's fields, all set in ``Controller.__init__`` (``machine.py``)."""

    spec: JobSpec
    events: EventLog
    callbacks: list[Callback]
    group: WorkerGroupAPI
    committer: CheckpointCommitter | CommitGate | None
    allowed: list[int]
    step: int  # optimizer steps committed by every rank
    failures: int
    dp_history: list[list[int]]
    losses: dict[int, float]
    tokens_per_s: list[float]
    outages: Outages
    health: HealthMonitor
    _pending: dict[int, StepTally]  # step -> its reports so far
    _recovered_at_step: int
    _base_step: int  # the step the current generation started from
    clock: Callable[[], float]


class StepAccounting(ControllerFields):
    def _collect(self, rank: int, result: WorkerReport | StepRows) -> WorkerFailure | None:
        """One report from a rank; returns an eviction a health policy asks for."""
        if isinstance(result, UploadReport):  # storage tier: a rank's part of a checkpoint (may trail its step)
            if self.committer is not None:
                self.committer.add(rank, result)
            return None
        if isinstance(result, AnomalyReport):
            self._on_anomaly(rank, result)
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
        for cb in self.callbacks:
            cb.after_step(step, self.group)
        return evict

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
