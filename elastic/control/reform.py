"""The steps every re-formation is made of, carried out on the worker group (driver side).

Each function acts on the group and returns what it found; none changes the controller's
state, which the controller (``controller.py``) updates from the returned values. The
sequences they serve:

* a failure: free the survivors (:func:`free_survivors`), choose the restore source with
  one snapshot query (:func:`choose_restore`), plan and re-form (:func:`reform`);
* a resize (capacity returned), a drain at a step boundary and a graceful stop: stop every
  rank after the same step and collect what it reported (:func:`stop_at_boundary`), then
  re-form or checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.control import recovery_plan as plan
from elastic.control.recovery_plan import Holdings, ReformPlan, RestoreChoice
from elastic.control.timing import PhaseTimer
from elastic.control.worker_group.api import ConfigureResult, Member, WorkerGroupAPI
from elastic.errors import WorkerFailure
from elastic.messages import StepReport, StepRows, WorkerReport

if TYPE_CHECKING:
    from elastic.spec import JobSpec

logger = logging.getLogger(__name__)

STORAGE_COMMIT_WAIT_S = 60.0  # a commit in flight may be the newest checkpoint


@dataclass
class Boundary:
    """What stopping at a step boundary found: the ranks that did not stop in time, the
    reports collected on the way, and a failure seen meanwhile."""

    stuck: list[Member] = field(default_factory=list)
    reports: list[tuple[int, WorkerReport]] = field(default_factory=list)
    failure: WorkerFailure | None = None


@dataclass(frozen=True)
class Reformed:
    plan: ReformPlan[Member]
    result: ConfigureResult
    breakdown: dict[str, float]
    configured_at: float  # driver clock


def stop_at_boundary(group: WorkerGroupAPI, members: Sequence[Member], timeout: float) -> Boundary:
    """Ask every rank to stop after the step in flight; wait for ``members`` to leave
    ``run()`` and collect what they reported. The one home of this sequence."""
    group.request_stop()
    stuck = group.wait_runs(members, timeout=timeout)
    obs = group.observe(timeout=0)
    return Boundary(stuck=stuck, reports=list(obs.results), failure=obs.failure)


HUNG_GRACE_S = 2.0  # the least time survivors get to leave run() after a failure


def survivors_wait_s(step_time_s: float, collective_timeout_s: float, device: str) -> float:
    """How long the survivors of a failure get to leave ``run()`` before they count as hung.

    On gloo (CPU), a survivor's next collective with a peer that left fails within
    milliseconds, so a healthy one is out within one step of its own; one still inside after
    three steps (``HUNG_GRACE_S`` at least) is stuck in its own step (a hung rank), and is
    killed now rather than waited for until the collective timeout. On NCCL a collective
    with a lost peer blocks until the timeout (or an abort), so there the timeout stays the
    bound.
    """
    if device != "cpu":
        return collective_timeout_s + 5
    return min(collective_timeout_s + 5, max(HUNG_GRACE_S, 3 * step_time_s))


def free_survivors(
    group: WorkerGroupAPI,
    culprits: Sequence[Member],
    timeout: float,
    *,
    stop: bool = False,
    shrink_unit: int | None = None,
) -> tuple[list[Member], Boundary]:
    """Kill ``culprits``, wait for every other live member to leave ``run()`` (killing
    those that cannot), and collect the steps they finished meanwhile. With ``stop``, the
    others are also asked to stop at the step boundary (a drain that cannot wait).

    ``shrink_unit`` (NCCL, the replica size): the culprits' whole replicas are killed, and
    the others shrink the group without them at once (``WorkerGroup.shrink``), which aborts
    the collectives they are blocked in instead of waiting out the collective timeout."""
    lost: set[int] = set()
    if shrink_unit and culprits:
        lost = {m.rank // shrink_unit for m in culprits}
        culprits = [m for m in group.members if m.rank // shrink_unit in lost]
        excluded = sorted({m.rank for m in culprits} | {m.rank for m in group.members if m.dead})
    group.kill(culprits)
    if lost:
        group.shrink([m for m in group.members if not m.dead], excluded)
    elif culprits and not stop:  # survivors still computing leave the step now, not at its end,
        # and cut their links to the lost ranks: a collective blocked on one fails at once
        dead = [m for m in group.members if m.dead]
        group.abort_steps([m for m in group.members if not m.dead], lost=dead)
    if stop:
        group.request_stop()
    gone = {id(m) for m in culprits}
    survivors = [m for m in group.members if id(m) not in gone and not m.dead]
    stuck = group.wait_runs(survivors, timeout=timeout)
    group.kill(stuck)
    stuck_ids = {id(m) for m in stuck}
    # One that died meanwhile is lost too: a second failure, or a survivor that left the job
    # while blocked in a collective after the abort (``report_if_stuck``).
    survivors = [m for m in survivors if id(m) not in stuck_ids and not m.dead]
    reports: list[tuple[int, WorkerReport]] = [
        (r, rep) for r, rep in group.drain_results(survivors) if isinstance(rep, StepReport | StepRows)
    ]
    return survivors, Boundary(stuck=stuck, reports=reports)


def choose_restore(
    spec: JobSpec, group: WorkerGroupAPI, committer: Any, holders: Sequence[Member]
) -> tuple[RestoreChoice, list[tuple[Member, Holdings | None]]]:
    """The newest step the ``holders``' snapshots cover, else the newest storage checkpoint,
    else a fresh start; and the holdings themselves (asked once, for the plan too)."""
    holdings = group.snapshot_holdings(holders)
    pairs = list(zip(holders, holdings))
    p = spec.parallel
    step = plan.covering_step(holdings, group.dp * p.replica_size, p.tp, p.pp, p.zero, p.ep, p.cp, p.shard_group)
    if step is not None:
        return RestoreChoice(step, "memory"), pairs
    if committer is not None:
        committer.join(timeout=STORAGE_COMMIT_WAIT_S)
        from elastic.checkpoint.restore import latest_storage_step

        step = latest_storage_step(spec, group.storage_uri)
        if step is not None:
            return RestoreChoice(step, "storage"), pairs
    logger.warning("no snapshot in memory or storage covers the lost shards: training restarts from step 0")
    return RestoreChoice(None, "none"), pairs


def reform(
    spec: JobSpec,
    group: WorkerGroupAPI,
    members: Sequence[Member],
    dp: int,
    step: int,
    choice: RestoreChoice,
    holdings: Sequence[tuple[Member, Holdings | None]],
    timer: PhaseTimer,
    before: Callable[[Sequence[Member]], None] | None = None,
) -> Reformed:
    """Plan the new layout of ``members`` at ``dp`` and re-form it; ``before`` sees the
    members in their new rank order just before they re-form."""
    p = spec.parallel
    reform_plan = plan.plan_reform(
        members,
        dp,
        step,
        choice,
        holdings,
        tp=p.tp,
        pp=p.pp,
        zero=p.zero,
        replicate=spec.checkpoint.replicate,
        rack_of=group.rack_of,
        ep=p.ep,
        cp=p.cp,
        shard_group=p.shard_group,
        old_dp=group.dp,
    )
    if before is not None:
        before(reform_plan.members)
    timer.mark("decide_s")
    result = group.reform(reform_plan)
    configured_at = timer.configured(result)
    return Reformed(reform_plan, result, timer.rounded(), configured_at)


def release_dead_groups(group: WorkerGroupAPI) -> None:
    """Give back the placement groups whose every member is dead."""
    live = {id(m.group) for m in group.members if not m.dead}
    released: set[int] = set()
    for m in group.members:
        if m.dead and id(m.group) not in live and id(m.group) not in released:
            released.add(id(m.group))
            group.release_group(m.group)
