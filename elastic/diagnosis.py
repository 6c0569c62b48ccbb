"""Failure diagnosis: turn what the worker group observed into one typed failure.

Pure apart from the raylet liveness probe: it reads the members' last poll times, their
returned ``run()`` results and Ray's death notices, and names the cause and the ranks at
fault (DESIGN.md's ``failure.cause``).
"""

from __future__ import annotations

import socket
import time
from typing import Any

from elastic.errors import ActorDied, CollectiveTimeout, HeartbeatTimeout, NodeLost, WorkerError, WorkerFailure

PEER_GRACE_S = 0.5  # after a peer error, how long a silent rank has to answer before it counts as dead
NODE_PROBE_S = 1.0  # how long a dead rank's raylet is probed before the loss counts as one process


def diagnose(members: list[Any], elastic: Any, now: float, raylets: dict[str, tuple[str, int]]) -> WorkerFailure | None:
    """Turn evidence into one typed failure, attributed to the ranks at fault.

    A rank that dies is usually seen first by its peers: their collective fails with
    "Connection closed" within milliseconds, long before Ray marks the actor dead.
    So once a peer error is seen, the ranks still inside ``run()`` that also stopped
    answering polls for ``PEER_GRACE_S`` are the dead ones.
    """
    dead = [m for m in members if m.dead]
    peer_errors = [m for m in members if m.run_result and m.run_result.get("kind") == "peer"]
    if peer_errors and not dead:
        first = min(m.run_result["error_at"] for m in peer_errors)
        if time.time() - first >= PEER_GRACE_S:
            # Silence alone is not death: a loaded machine can delay a poll. A suspect
            # counts as dead once its node's raylet is gone; a lone dead process on a live
            # node is confirmed by Ray within moments, and a hung one by the heartbeat.
            suspects = [m for m in members if m.run_result is None and now - m.last_ok >= PEER_GRACE_S]
            gone = probe_dead_nodes({m.node_id for m in suspects}, raylets, wait_s=0.0)
            dead = [m for m in suspects if m.node_id in gone]
    if dead:
        lost_nodes = _lost_nodes(members, dead, raylets)
        cls = NodeLost if lost_nodes else ActorDied
        return cls(
            f"{len(dead)} worker(s) died" + (f"; node(s) {sorted(lost_nodes)} left the cluster" if lost_nodes else ""),
            ranks=[m.rank for m in dead],
            nodes=sorted({m.node_id for m in dead}),
        )
    hb = elastic.heartbeat_timeout_s
    silent = [m for m in members if now - m.last_ok > hb]
    if silent:
        return HeartbeatTimeout(
            f"no heartbeat for more than {hb:g}s",
            ranks=[m.rank for m in silent],
            nodes=sorted({m.node_id for m in silent}),
        )
    errors = {m.rank: m.run_result for m in members if m.run_result and m.run_result["status"] == "error"}
    own = [r for r, res in errors.items() if res["kind"] == "worker_error"]
    if own:
        return WorkerError(errors[own[0]]["detail"], ranks=own, nodes=_nodes_of(members, own))
    timeouts = [r for r, res in errors.items() if res["kind"] == "timeout"]
    if timeouts:
        hung = [m.rank for m in members if m.run_result is None]
        return CollectiveTimeout(
            f"a collective did not finish within {elastic.collective_timeout_s:g}s",
            ranks=hung or timeouts,
            nodes=_nodes_of(members, hung or timeouts),
        )
    return None


def _lost_nodes(members: list[Any], dead: list[Any], raylets: dict[str, tuple[str, int]]) -> set[str]:
    """Nodes whose every member died and whose raylet no longer accepts connections."""
    candidates = {m.node_id for m in dead}
    candidates = {n for n in candidates if all(m.dead or m in dead for m in members if m.node_id == n)}
    if not candidates:
        return set()
    return probe_dead_nodes(candidates, raylets, wait_s=NODE_PROBE_S)


def _nodes_of(members: list[Any], ranks: list[int]) -> list[str]:
    return sorted({m.node_id for m in members if m.rank in ranks})


def probe_dead_nodes(node_ids: set[str], raylets: dict[str, tuple[str, int]], wait_s: float) -> set[str]:
    """Nodes whose raylet refuses (or does not answer) a TCP connection, probed up to ``wait_s``.

    Ray's node table can report a lost node alive for tens of seconds (DESIGN.md section 8);
    a refused connection to its raylet is immediate evidence that the node is gone.
    """
    deadline = time.monotonic() + wait_s
    while True:
        dead = set()
        for n in node_ids:
            addr = raylets.get(n)
            if addr is None:
                continue
            try:
                with socket.create_connection(addr, timeout=0.2):
                    pass
            except OSError:
                dead.add(n)
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)
