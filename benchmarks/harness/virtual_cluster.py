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
    """``ReplicaSlots`` over the virtual cluster: one group per live node."""

    def __init__(self, nodes: list[str]):
        self.groups = {n: VirtualGroup(n) for n in nodes}

    def request(self, total: int) -> None:
        pass

    def ready(self, timeout: float = 0.0) -> list[VirtualGroup]:
        return list(self.groups.values())

    def exclude(self, nodes: set[str], keep: set[int]) -> None:
        for n in nodes:
            self.groups.pop(n, None)

    def release(self, group: VirtualGroup) -> None:
        self.groups.pop(group.node, None)

    def release_all(self) -> None:
        self.groups.clear()

    def add(self, node: str) -> None:
        self.groups[node] = VirtualGroup(node)


def virtual_group_class(world: Any, nodes: list[str], raylets: Raylets, real_agents: set[str], fan_in: int):
    """The project's ``WorkerGroup`` with the virtual cluster's capacity, ranks and agents."""
    from elastic.agent.actors import NodeAgent
    from elastic.control.worker_group import Member, WorkerGroup
    from elastic.testing.virtual_nodes import LocalVirtualAgent, VirtualRankRef

    class Group(WorkerGroup):
        agent_fan_in = fan_in

        def _make_slots(self):
            self.virtual = VirtualSlots(nodes)
            return self.virtual

        def _make_agent(self, node: str):
            if node in real_agents:
                return NodeAgent.options(name=None).remote(node, world.poll_wait_s, virtual=world)
            return LocalVirtualAgent(node, world)

        def spawn(self, groups):
            members = [Member(None, g, b, g.node, "10.0.0.1", 0) for g in groups for b in range(self.replica_size)]
            self.state.number(members)
            for m in members:
                m.actor = VirtualRankRef(m.wid)
            self.raylets.update({g.node: raylets.address(g.node) for g in groups})
            self._attach(members)
            return members

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
