"""Nodes that Ray drains leave without a failure (``docs/faults.md``, "Drained nodes").

Ray marks a node as draining when the autoscaler is about to remove it (idle termination,
a spot/preemption notice) or when someone runs ``ray drain-node``. The GCS node table shows
it (``state_snapshot.state == DRAINING``) with the deadline after which the node will be
force-killed (``ray._private.state.state.get_draining_nodes()``, 0 for none). Ray 2.60
publishes a drain's *reason* only in the node's death record, once it is gone, so
``drain_reason`` is ``unspecified`` while it drains unless Ray already recorded one.

:class:`DrainWatch` looks at the node table every ``DRAIN_POLL_S`` while the job trains. When
a node hosting workers drains, :func:`shrink` removes the whole replicas on it, as a resize:

* normally at the next step boundary: every rank stops after the same step, the survivors
  re-form in place (gradient accumulation keeps the global batch) and restore that step from
  memory; the drained workers are still alive, so their snapshots count, and only then are
  they killed. No step is lost and no ``failure`` is recorded;
* if the deadline is too near to finish the step in flight, the drained workers are dropped
  at once and the survivors restore the previous step's snapshot.

Nodes that are draining are not used to grow back (``WorkerGroup.avoid_nodes``) until Ray
shows them as usable again (no longer draining).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from elastic.control import recovery_plan as plan
from elastic.control.states import Running, State
from elastic.errors import WorkerFailure
from elastic.messages import StepReport

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.5  # how often the node table is read while training (a ~1 ms GCS call)
URGENT_MARGIN_S = 1.0  # deadline closer than this plus ~1.5 step times: drop the replicas at once
_DEATH_REASONS = {"AUTOSCALER_DRAIN_PREEMPTED": "preemption", "AUTOSCALER_DRAIN_IDLE": "idle_termination"}


@dataclass(frozen=True)
class DrainNotice:
    node_id: str
    deadline: float | None  # on the driver's monotonic clock; None: no deadline
    reason: str


def draining_nodes(timeout_s: float = 2.0) -> dict[str, DrainNotice]:
    """Live nodes that Ray marks as draining, with their deadlines."""
    import ray
    from ray.core.generated import gcs_pb2

    gcs = ray._private.worker.global_worker.gcs_client
    infos = gcs.get_all_node_info(timeout=timeout_s)
    deadlines_ms = ray._private.state.state.get_draining_nodes()
    now_wall, now = time.time(), time.monotonic()
    out = {}
    for node, info in infos.items():
        node_id = node.hex()
        if info.state != gcs_pb2.GcsNodeInfo.ALIVE:
            continue
        if info.state_snapshot.state != gcs_pb2.NodeSnapshot.DRAINING and node_id not in deadlines_ms:
            continue
        ms = deadlines_ms.get(node_id, 0)
        deadline = now + (ms / 1000.0 - now_wall) if ms else None
        out[node_id] = DrainNotice(node_id, deadline, _reason(info))
    return out


def _reason(info: Any) -> str:
    try:
        from ray.core.generated import gcs_pb2

        name = gcs_pb2.NodeDeathInfo.Reason.Name(info.death_info.reason)
    except Exception:  # noqa: BLE001 - an unknown enum value
        return "unspecified"
    return _DEATH_REASONS.get(name, "unspecified")


class DrainWatch:
    """Reads the node table while the job trains and shrinks around draining nodes."""

    def __init__(self) -> None:
        self._last_poll = 0.0
        self._given_up: set[str] = set()  # drained nodes the job cannot shrink around

    def act(self, ctl: Any, state: State) -> State:
        now = time.monotonic()
        if now - self._last_poll < DRAIN_POLL_S or not _is_ray_group(ctl.group):
            return state
        self._last_poll = now
        try:
            notices = draining_nodes()
        except Exception as exc:  # noqa: BLE001 - the GCS is busy: look again at the next poll
            log.debug("reading draining nodes failed: %s", exc)
            return state
        ctl.group.avoid_nodes = set(notices)  # not used to grow back while draining
        live = {m.node_id for m in ctl.group.members if not m.dead}
        hit = {n: d for n, d in notices.items() if n in live and n not in self._given_up}
        if not hit:
            return state
        new_state = shrink(ctl, hit)
        if new_state is None:
            self._given_up |= set(hit)
            return state
        return new_state


def _is_ray_group(group: Any) -> bool:
    from elastic.control.worker_group import WorkerGroup

    return isinstance(group, WorkerGroup)


def _step_time_s(ctl: Any) -> float:
    if not ctl.tokens_per_s or ctl.tokens_per_s[-1] <= 0:
        return 1.0
    return ctl.spec.train.global_batch * ctl.spec.model.seq_len / ctl.tokens_per_s[-1]


def shrink(ctl: Any, hit: dict[str, DrainNotice]) -> State | None:
    """Remove the whole replicas on the drained nodes; None when no allowed DP is left."""
    group, e = ctl.group, ctl.spec.elastic
    t_notice = time.monotonic()
    replicas = group.complete_replicas([m for m in group.members if not m.dead])
    keep = [r for r in replicas if not any(m.node_id in hit for m in r)]
    spare = group.spare_groups()
    recovery = plan.plan_recovery(len(keep), len(spare), ctl.allowed)
    if recovery is None:
        log.warning(
            "node(s) %s are draining but %d whole replica(s) elsewhere reach no allowed DP (%s): "
            "training goes on there until they leave",
            sorted(hit),
            len(keep),
            ctl.allowed,
        )
        return None
    deadlines = [d.deadline for d in hit.values() if d.deadline is not None]
    left_s = min(deadlines) - t_notice if deadlines else None
    urgent = left_s is not None and left_s < 1.5 * _step_time_s(ctl) + URGENT_MARGIN_S
    kept = [m for r in keep[: recovery.keep] for m in r]
    leaving = [m for m in group.members if m not in kept]
    old_dp = group.dp
    log.warning(
        "node(s) %s are draining (deadline in %s): removing %d worker(s) %s",
        sorted(hit),
        "none" if left_s is None else f"{left_s:.1f}s",
        len(leaving),
        "at once (too near to finish the step)" if urgent else "at the next step boundary",
    )
    if urgent:
        group.kill(leaving)
        group.request_stop()
        stuck = group.wait_runs(kept, timeout=e.collective_timeout_s + 5)
        if stuck:
            return ctl._recovering(WorkerFailure("workers did not stop after a drain", ranks=[m.rank for m in stuck]))
        for rank, result in group.drain_results(kept):
            if isinstance(result, StepReport) and result.step > ctl.step:
                ctl._pending.setdefault(result.step, {})[rank] = result
        last_seen = ctl._last_seen_step()
        t_stopped = time.monotonic()
        newcomers = group.spawn(spare[: recovery.grow]) if recovery.grow else []
        restore_step, source = ctl._restore_source(kept)
        t = group.configure(kept + newcomers, recovery.dp, restore_step or 0, restore_step, source)
    else:
        group.request_stop()
        stuck = group.wait_runs(group.members, timeout=e.collective_timeout_s + 5)
        obs = group.observe(timeout=0)
        for rank, result in obs.results:
            ctl._collect(rank, result)
        if stuck or obs.failure is not None:
            return ctl._recovering(
                obs.failure or WorkerFailure("workers did not stop at a step boundary", ranks=[m.rank for m in stuck])
            )
        last_seen = ctl.step
        t_stopped = time.monotonic()
        newcomers = group.spawn(spare[: recovery.grow]) if recovery.grow else []
        # The leaving workers are still alive: their snapshots of this step count.
        restore_step = group.common_snapshot_step(group.members)
        source = "memory"
        t = group.configure(kept + newcomers, recovery.dp, ctl.step, restore_step, source)
        group.kill(leaving)
    for pg in {id(m.group): m.group for m in leaving}.values():
        group.release_group(pg)
    group.request_capacity()
    ctl.step = t["step"]
    ctl._pending.clear()
    reason = sorted({d.reason for d in hit.values()})
    ctl.events.emit(
        "resize",
        old_dp=old_dp,
        new_dp=recovery.dp,
        grad_accum=ctl.spec.grad_accum(recovery.dp),
        reason="drain",
        drain_reason=reason[0] if len(reason) == 1 else ",".join(reason),
        nodes=sorted(hit),
        deadline_s=None if left_s is None else round(left_s, 3),
        at_once=urgent,
        lost_steps=max(0, last_seen - ctl.step),
        reform_s=round(time.monotonic() - t_notice, 3),
        stop_s=round(t_stopped - t_notice, 3),  # of which: until every rank left the step (and was collected)
    )
    if source != "none":
        ctl.events.emit("restore", step=ctl.step, source=source, duration_s=t["restore_s"])
    if recovery.dp != old_dp:
        ctl.dp_history.append([ctl.step, recovery.dp])
    return Running()
