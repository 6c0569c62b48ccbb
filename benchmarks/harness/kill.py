"""Kill a node of a local cluster with the project's fault tool (``elastic.faults.kill_node``:
SIGKILL of every process that is a child of its raylet, then ``Cluster.remove_node``), and
add one back, stamping the moments around each. Runs in a benchmark's driver process: a kill
often from a thread (the controller is not to be held by ``remove_node``), an added node from
the main thread (Ray starts nodes from the main thread only: signal handlers).
"""

from __future__ import annotations

import time
from typing import Any


class PidsGroup:
    """The one worker-group query ``kill_node`` makes: the pids known to run on a node."""

    def __init__(self, pids_by_node: dict[str, list[int]]):
        self.pids_by_node = pids_by_node

    def pids_on_node(self, node_id: str) -> list[int]:
        return list(self.pids_by_node.get(node_id, []))


def node_index_of(cluster: Any, node_id: str) -> int:
    """The index ``kill_node`` takes for the worker node ``node_id``."""
    from elastic.faults import worker_nodes

    return [n.node_id for n in worker_nodes(cluster)].index(node_id)


def kill_node_now(out: dict[str, Any], cluster: Any, node_id: str, pids: list[int]) -> None:
    """Stamp ``kill_ts`` just before the SIGKILL, kill node ``node_id`` (and ``pids``, the
    processes known to run there), stamp ``kill_done_ts`` once it is removed."""
    from elastic.faults import kill_node

    index = node_index_of(cluster, node_id)
    out["killed_node_id"] = node_id
    out["kill_ts"] = time.time()
    kill_node(cluster, index, PidsGroup({node_id: pids}))
    out["kill_done_ts"] = time.time()


def add_node_now(out: dict[str, Any], cluster: Any, **node_args: Any) -> None:
    """Add a node back, stamping ``node_added_ts`` before and ``node_added_done_ts`` once it is up."""
    out["node_added_ts"] = time.time()
    cluster.add_node(**node_args)
    out["node_added_done_ts"] = time.time()


def rejoin_figures(out: dict[str, Any], first_full_step_ts: float, note: str) -> dict[str, Any]:
    """From the node being up (``add_node_now``) to the first step at full size, and how long
    adding the node took."""
    return {
        "rejoin_s": first_full_step_ts - out["node_added_done_ts"],
        "add_node_s": out["node_added_done_ts"] - out["node_added_ts"],
        "rejoin_note": note,
    }
