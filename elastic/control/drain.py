"""Nodes that Ray drains leave without a failure (``docs/faults.md``, "Drained nodes").

Ray marks a node as draining when the autoscaler is about to remove it (idle termination,
a spot/preemption notice) or when someone runs ``ray drain-node``. The GCS node table shows
it (``state_snapshot.state == DRAINING``) with the deadline after which the node will be
force-killed (``ray._private.state.state.get_draining_nodes()``, 0 for none). Ray 2.60
publishes a drain's *reason* only in the node's death record, once it is gone, so
``drain_reason`` is ``unspecified`` while it drains unless Ray already recorded one.

:class:`DrainWatch` looks at the node table every ``DRAIN_POLL_S`` while the job trains. When
a node hosting workers drains, :func:`shrink_intent` says how to remove the whole replicas on
it, and the controller carries that out as a resize:

* normally at the next step boundary: every rank stops after the same step, the survivors
  re-form in place (gradient accumulation keeps the global batch) and restore that step from
  memory; the drained workers are still alive, so their snapshots count, and only then are
  they killed. No step is lost and no ``failure`` is recorded;
* if the deadline is too near to finish the step in flight, the drained workers are dropped
  at once and the survivors restore the previous step's snapshot.

Nodes that are draining are not used to grow back (``WorkerGroup.avoid``) until Ray
shows them as usable again (no longer draining).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, cast

from elastic.control.recovery_plan import RecoveryPlan, plan_recovery

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

    # The GCS client is set on the worker when it connects (no attribute declared for mypy).
    gcs = cast(Any, ray._private.worker.global_worker).gcs_client
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


@dataclass(frozen=True)
class Shrink:
    """The intent to remove the whole replicas on draining nodes: carried out by the
    controller at the next step boundary, or at once when ``urgent`` (the deadline is too
    near to finish the step in flight)."""

    notices: dict[str, DrainNotice]
    plan: RecoveryPlan  # keep the first ``plan.keep`` of the replicas off those nodes
    urgent: bool
    left_s: float | None  # the nearest deadline, seconds from the notice

    @property
    def reason(self) -> str:
        reasons = sorted({d.reason for d in self.notices.values()})
        return reasons[0] if len(reasons) == 1 else ",".join(reasons)


class DrainWatch:
    """Reads the drain notices every ``DRAIN_POLL_S`` while the job trains and says which
    live nodes the job should shrink around. Pure but for the clock: the notices come from
    the worker group (``WorkerGroupAPI.draining_nodes``)."""

    def __init__(self) -> None:
        self._last_poll = 0.0
        self._given_up: set[str] = set()  # drained nodes the job cannot shrink around

    def due(self, now: float) -> bool:
        if now - self._last_poll < DRAIN_POLL_S:
            return False
        self._last_poll = now
        return True

    def hit(self, notices: dict[str, DrainNotice], live_nodes: set[str]) -> dict[str, DrainNotice]:
        """The draining nodes that host live workers and have not been given up on."""
        return {n: d for n, d in notices.items() if n in live_nodes and n not in self._given_up}

    def give_up(self, nodes: set[str]) -> None:
        """No allowed DP is left without these nodes: training goes on there until they leave."""
        self._given_up |= nodes


def shrink_intent(
    hit: dict[str, DrainNotice],
    replicas_off: int,
    spare: int,
    allowed: list[int],
    step_time_s: float,
    now: float,
) -> Shrink | None:
    """Shrink around the ``hit`` nodes, keeping ``replicas_off`` whole replicas that are on
    none of them (plus ``spare`` placement groups); None when no allowed DP is left."""
    plan = plan_recovery(replicas_off, spare, allowed)
    if plan is None:
        return None
    deadlines = [d.deadline for d in hit.values() if d.deadline is not None]
    left_s = min(deadlines) - now if deadlines else None
    urgent = left_s is not None and left_s < 1.5 * step_time_s + URGENT_MARGIN_S
    return Shrink(hit, plan, urgent, left_s)
