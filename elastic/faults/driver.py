"""Faults fired from the driver (they run in the driver's process, as a controller callback).

``FaultInjector`` acts on processes with real signals when step ``k`` completes: SIGKILL a
worker, SIGSTOP a worker, or kill a whole node of a ``ray.cluster_utils.Cluster`` (SIGKILL
its worker processes, then ``remove_node``), and optionally bring a node back later.
``drain`` asks Ray itself to drain a node (``GcsClient.drain_node``, the API of ``ray
drain-node`` and of autoscaler v2) with a deadline, as a preemption notice does, and
reclaims the node (``kill_node``) when the deadline passes if it is still there.

Driver-side signals need the workers on the driver's machine: that is the case for the
embedded and ``Cluster``-based local clusters these faults are made for.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic.control.callbacks import Callback
from elastic.faults.nodes import drain_node, is_local, kill_node, kill_quietly, worker_nodes

log = logging.getLogger(__name__)

DRIVER_FAULT_KINDS = ("kill_worker", "stop_worker", "kill_node", "drain")
DRAIN_DEADLINE_S = 30.0  # drain: the default notice before the node is reclaimed


@dataclass
class Fault:
    """A driver-side fault fired after step ``at_step`` completes.

    With ``during_recovery=n`` it fires instead inside the n-th failure's recovery, after
    the survivors were chosen and before they re-rendezvous: a loss mid-reconfiguration.
    """

    kind: str  # kill_worker | stop_worker | kill_node | drain
    at_step: int = 0
    during_recovery: int | None = None
    rank: int | None = None  # kill_worker / stop_worker: the rank at that moment
    node_index: int | None = None  # kill_node: index into the cluster's worker nodes (else the node of ``rank``)
    return_after_s: float | None = None  # kill_node: add an equal node back after this delay
    graceful_raylet: bool = False  # kill_node: SIGTERM the node's raylet instead of SIGKILL (quieter logs)
    delay_s: float = 0.0  # during_recovery: fire this long after the re-rendezvous starts (from a thread)
    deadline_s: float = DRAIN_DEADLINE_S  # drain: the notice given before the node is reclaimed
    fired_at: float | None = field(default=None, init=False)


class FaultInjector(Callback):
    """Controller callback that fires driver-side faults with real signals."""

    def __init__(self, faults: list[Fault], cluster: Any = None, node_args: dict[str, Any] | None = None):
        self.faults = list(faults)
        self.cluster = cluster
        self.node_args = node_args or {}
        self.returned_nodes: list[Any] = []
        self._stopped_pids: list[int] = []
        self._due: list[float] = []  # monotonic times at which to add a node back
        self._reclaims: list[tuple[float, Any]] = []  # (monotonic deadline, node) of drained nodes
        self.drained: list[tuple[float, str]] = []  # (wall time, node id) of each drain request
        self._next_members: Sequence[Any] | None = None  # during before_reconfigure: the layout to come

    def after_step(self, step: int, group: Any) -> None:
        self._reclaim_due_nodes(group)
        self._return_due_nodes()
        for fault in self.faults:
            if fault.fired_at is None and fault.during_recovery is None and step >= fault.at_step:
                self._fire(fault, group)

    def before_reconfigure(self, recovery: int, group: Any, members: Sequence[Any]) -> None:
        """``rank`` in a fault fired here is a rank of the layout about to be configured."""
        for fault in self.faults:
            if fault.fired_at is None and fault.during_recovery == recovery:
                self._next_members = members
                try:
                    if fault.delay_s > 0:  # resolve the target now, kill it once the rendezvous runs
                        pid = self._pid(fault, group)
                        fault.fired_at = time.time()
                        threading.Timer(fault.delay_s, kill_quietly, (pid,)).start()
                    else:
                        self._fire(fault, group)
                finally:
                    self._next_members = None

    def _fire(self, fault: Fault, group: Any) -> None:
        fault.fired_at = time.time()
        getattr(self, f"_{fault.kind}")(fault, group)

    def _kill_worker(self, fault: Fault, group: Any) -> None:
        pid = self._pid(fault, group)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def _stop_worker(self, fault: Fault, group: Any) -> None:
        pid = self._pid(fault, group)
        if pid is not None:
            self._stopped_pids.append(pid)
            os.kill(pid, signal.SIGSTOP)

    def _pid(self, fault: Fault, group: Any) -> int | None:
        """The pid of ``fault.rank`` now (in a recovery: of the layout to come), or None
        (with a warning) when the job has no such rank at this moment (it shrank) or the
        worker is not on this machine."""
        members = getattr(group, "members", None)
        if self._next_members is not None:
            ranked = list(enumerate(self._next_members))
        else:
            ranked = [(m.rank, m) for m in members or []]
        member = (
            None
            if members is None
            else next((m for r, m in ranked if r == fault.rank and not getattr(m, "dead", False)), None)
        )
        if members is not None and member is None:
            log.warning("fault %s@%d: no rank %s at this step; not fired", fault.kind, fault.at_step, fault.rank)
            return None
        ip = getattr(member, "ip", None)
        if ip and not is_local(ip):
            log.warning(
                "fault %s@%d: rank %s runs on %s, not on this machine; not fired",
                fault.kind,
                fault.at_step,
                fault.rank,
                ip,
            )
            return None
        return member.pid if member is not None else group.pid_of(fault.rank)

    def _node_index(self, fault: Fault, group: Any) -> int | None:
        index = fault.node_index
        if index is None:  # the node hosting ``fault.rank``
            members = self._next_members or sorted(group.members, key=lambda m: m.rank)
            host = members[fault.rank].node_id
            index = next(i for i, n in enumerate(worker_nodes(self.cluster)) if n.node_id == host)
        if index >= len(worker_nodes(self.cluster)):
            log.warning("fault %s@%d: no worker node %d left; not fired", fault.kind, fault.at_step, index)
            return None
        return index

    def _drain(self, fault: Fault, group: Any) -> Any:
        """Ray's own drain (a preemption notice with a deadline); the node is reclaimed at the deadline."""
        index = self._node_index(fault, group)
        if index is None:
            return None
        node = worker_nodes(self.cluster)[index]
        drain_node(node.node_id, fault.deadline_s, message=f"elastic fault drain@{fault.at_step}")
        self.drained.append((time.time(), node.node_id))
        self._reclaims.append((time.monotonic() + fault.deadline_s, node))
        if fault.return_after_s is not None:
            self._due.append(time.monotonic() + fault.return_after_s)
        return node

    def _reclaim_due_nodes(self, group: Any) -> None:
        """A drained node still there at its deadline is killed, as a cloud reclaims it."""
        now = time.monotonic()
        for item in [r for r in self._reclaims if r[0] <= now]:
            self._reclaims.remove(item)
            nodes = worker_nodes(self.cluster)
            if item[1] in nodes:
                kill_node(self.cluster, nodes.index(item[1]), group, graceful_raylet=True)

    def _kill_node(self, fault: Fault, group: Any) -> None:
        index = self._node_index(fault, group)
        if index is None:
            return None
        node = kill_node(self.cluster, index, group, graceful_raylet=fault.graceful_raylet)
        if fault.return_after_s is not None:
            self._due.append(time.monotonic() + fault.return_after_s)
        return node

    def _return_due_nodes(self) -> None:
        """Add nodes back once due. Ray's ``add_node`` must run on the main thread, which is
        where the controller calls its callbacks."""
        now = time.monotonic()
        for due in [d for d in self._due if d <= now]:
            self._due.remove(due)
            self.returned_nodes.append(self.cluster.add_node(**self.node_args))

    def close(self) -> None:
        for pid in self._stopped_pids:  # never leave a stopped process behind
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
