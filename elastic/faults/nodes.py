"""Killing and draining the nodes of a local cluster, from the driver's process: what
``FaultInjector`` and the benchmarks do to a ``ray.cluster_utils.Cluster`` (Linux procfs and
signals, so the processes must be on this machine)."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any


def kill_node(cluster: Any, node_index: int, group: Any = None, graceful_raylet: bool = False) -> Any:
    """SIGKILL every worker process on a worker node, then remove the node from the cluster.

    Removing the node alone would leave its worker processes alive (see "kill_node" in ``docs/faults.md``).
    """
    node = worker_nodes(cluster)[node_index]
    node_id = node.node_id
    pids = set(group.pids_on_node(node_id)) if group is not None else set()
    # Every worker process of the node is a child of its raylet. (Ray's state API would
    # also list them, but it can block for 30 s when the dashboard is busy.)
    for info in node.all_processes.get("raylet", []):
        pids |= _children(info.process.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.remove_node(node, allow_graceful=graceful_raylet)
    return node


def drain_node(node_id: str, deadline_s: float | None, reason: str = "preemption", message: str = "") -> None:
    """Ask Ray to drain ``node_id`` (``ray drain-node``'s API, the one autoscaler v2 uses).

    ``reason``: ``preemption`` or ``idle_termination``. Ray does not kill the node at the
    deadline: the caller does (``FaultInjector`` reclaims it).
    """
    import ray
    from ray.core.generated import autoscaler_pb2

    reasons = {
        "preemption": autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION,
        "idle_termination": autoscaler_pb2.DRAIN_NODE_REASON_IDLE_TERMINATION,
    }
    deadline_ms = 0 if deadline_s is None else int(time.time() * 1000 + deadline_s * 1000)
    gcs = ray._private.worker.global_worker.gcs_client
    accepted, why = gcs.drain_node(node_id, reasons[reason], message or f"drain {reason}", deadline_ms)
    if not accepted:
        raise RuntimeError(f"Ray did not accept the drain of node {node_id}: {why}")


def is_local(ip: str) -> bool:
    """Whether ``ip`` is an address of this machine (signals only reach local processes)."""
    if ip.startswith("127.") or ip in ("::1", "localhost"):
        return True
    try:
        import ray

        if ip == ray.util.get_node_ip_address():
            return True
    except Exception:  # noqa: BLE001 - no Ray connection: fall back on the host's names
        pass
    try:
        return ip in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


def _children(parent: int) -> set[int]:
    """Pids of ``parent``'s child processes (Linux procfs)."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:  # fields after the command: state, ppid, ...
            out.add(int(name))
    return out


def worker_nodes(cluster: Any) -> list[Any]:
    return [n for n in cluster.list_all_nodes() if n is not cluster.head_node]


def kill_quietly(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
