"""The virtual cluster of ``benchmarks/control_plane.py``: the project's ``WorkerGroup`` with
the ranks' process creation (``spawn``) and the cluster's capacity (``VirtualSlots``)
replaced, its agents real ``NodeAgent`` actors or ``NodeCore``s hosted in their aggregator,
its ranks virtual (``elastic/testing/virtual_nodes.py``); stand-in raylets are listening
sockets, so the driver's probes are real. Runs in the benchmark's driver process.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class VirtualGroup:
    """A placement group of the virtual cluster: one whole replica on one node."""

    node: str


class Raylets:
    """Stand-in raylets: one listening socket for every live node, and one of its own for a
    node to be lost (closed when it is: its probes are then refused)."""

    def __init__(self) -> None:
        self.live = self._listener()
        self.own: dict[str, socket.socket] = {}

    def _listener(self) -> socket.socket:
        s = socket.create_server(("127.0.0.1", 0), backlog=4096)
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()
        return s

    @staticmethod
    def _accept(s: socket.socket) -> None:
        while True:
            try:
                conn, _ = s.accept()
                conn.close()
            except OSError:
                return

    def address(self, node: str) -> tuple[str, int]:
        return (self.own[node] if node in self.own else self.live).getsockname()

    def set_apart(self, node: str) -> None:
        self.own[node] = self._listener()

    def lose(self, node: str) -> None:
        self.own[node].close()


class VirtualSlots:
    """``ReplicaSlots`` over the virtual cluster: one group per live node, each ready at once
    (its node is there), its ``replica_size`` bundles all on that node."""

    def __init__(self, nodes: list[str], replica_size: int):
        self.replica_size = replica_size
        self.groups = {n: VirtualGroup(n) for n in nodes}

    def request(self, total: int) -> None:
        pass  # capacity is the nodes there are: a node that returns is ``add``ed

    def ready(self, timeout: float = 0.0) -> list[VirtualGroup]:
        return list(self.groups.values())

    def exclude(self, nodes: set[str], keep: set[int]) -> None:
        for n in nodes:
            g = self.groups.get(n)
            if g is not None and id(g) not in keep:
                del self.groups[n]

    def release(self, group: VirtualGroup) -> None:
        if self.groups.get(group.node) is group:
            del self.groups[group.node]

    def release_all(self) -> None:
        self.groups.clear()

    def bundle_nodes(self, groups: list[VirtualGroup]) -> list[str]:
        """The node of each worker bundle of ``groups``: a whole replica on its group's node."""
        return [g.node for g in groups for _ in range(self.replica_size)]

    def actor_options(self, group: VirtualGroup, bundle_index: int) -> dict[str, Any]:
        """Where the rank of bundle ``bundle_index`` of ``group`` runs (the virtual spawn's
        placement, as Ray's scheduling strategy is the real one's)."""
        if not 0 <= bundle_index < self.replica_size:
            raise IndexError(f"bundle {bundle_index} of a {self.replica_size}-bundle group")
        return {"node": group.node, "bundle_index": bundle_index}

    def add(self, node: str) -> None:
        self.groups[node] = VirtualGroup(node)


@dataclass(eq=False)
class VirtualPending:
    """A virtual start in flight (``WorkerGroup.spawn_begin``'s ``PendingSpawn``): its ranks
    answer ``start_s`` after the start, as a real start's ``info()`` answers do."""

    members: list[Any]
    ready_at: float  # monotonic
    cancelled: bool = False


def virtual_group_class(
    world: Any, nodes: list[str], raylets: Raylets, real_agents: set[str], fan_in: int, start_s: float = 0.0
):
    """The project's ``WorkerGroup`` with the virtual cluster's capacity, ranks and agents; a
    start's ranks answer ``start_s`` after it (non-blocking, as the real ``spawn_begin``)."""
    from elastic.agent.actors import NodeAgent
    from elastic.control.worker_group import Member, WorkerGroup
    from elastic.testing.virtual_nodes import LocalVirtualAgent, VirtualRankRef

    class Group(WorkerGroup):
        agent_fan_in = fan_in

        def _make_slots(self):
            self.virtual = VirtualSlots(nodes, self.replica_size)
            return self.virtual

        def _make_agent(self, node: str):
            if node in real_agents:
                return NodeAgent.options(name=None).remote(node, world.poll_wait_s, virtual=world)
            return LocalVirtualAgent(node, world)

        def spawn_begin(self, groups):
            """The real start's order: the nodes' agents first (``_start_agents``, from the
            slots' ``bundle_nodes``), then one rank per bundle where ``actor_options`` puts it."""
            self._start_agents(groups)
            members = []
            for g in groups:
                for b in range(self.replica_size):
                    where = self.slots.actor_options(g, b)
                    members.append(Member(None, g, where["bundle_index"], where["node"], "10.0.0.1", 0))
            pending = VirtualPending(members, time.monotonic() + start_s)
            self._starting.append(pending)
            return pending

        def spawn_end(self, pending, wait_s):
            if pending.cancelled:
                raise RuntimeError("a cancelled start was collected")
            left = pending.ready_at - time.monotonic()
            if left > wait_s:
                time.sleep(max(0.0, wait_s))
                return None
            time.sleep(max(0.0, left))
            self._starting.remove(pending)
            members = pending.members
            self.state.number(members)
            for m in members:
                m.actor = VirtualRankRef(m.wid)
            self.raylets.update({m.node_id: raylets.address(m.node_id) for m in members})
            self._attach(members)
            return members

        def spawn_cancel(self, pending):
            pending.cancelled = True
            if pending in self._starting:
                self._starting.remove(pending)

    return Group


def tree_processes() -> dict[str, Any]:
    """The agent tree's actor processes on this machine (Ray names them ``ray::Class``): how
    many, and their resident memory."""
    count, rss_kb = {"Aggregator": 0, "NodeAgent": 0}, 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            kind = next((k for k in count if cmd.startswith(f"ray::{k}")), None)
            if kind is None:
                continue
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        count[kind] += 1
        rss_kb += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
    return {"processes": count, "rss_gib": round(rss_kb / 2**20, 2)}
