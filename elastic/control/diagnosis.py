"""Failure diagnosis: turn what the worker group observed into one typed failure.

Pure apart from the raylet liveness probe: it reads the members' last poll times, their
returned ``run()`` outcomes and Ray's death notices, and names the cause and the ranks at
fault (``failure.cause`` in ``docs/outputs.md``). Every time it compares is on the
driver's own monotonic clock: when a poll answer or a ``run()`` result arrived. No clock of
another host is ever compared with the driver's.
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from typing import Any, cast

from elastic.errors import (
    ActorDied,
    CollectiveTimeout,
    HeartbeatTimeout,
    LoaderStalled,
    NodeLost,
    NotRetryable,
    WorkerError,
    WorkerFailure,
)

PEER_GRACE_S = 0.5  # after a peer error, how long a silent rank has to answer before it counts as dead
NODE_PROBE_S = 1.0  # how long a dead rank's raylet is probed before the loss counts as one process


def diagnose(members: list[Any], elastic: Any, now: float, raylets: RayletProbe) -> WorkerFailure | None:
    """Turn evidence into one typed failure, attributed to the ranks at fault.

    A rank that dies is usually seen first by its peers: their collective fails with
    "Connection closed" within milliseconds, long before Ray marks the actor dead.
    So once a peer error is seen, the ranks still inside ``run()`` that also stopped
    answering polls for ``PEER_GRACE_S`` are the dead ones.
    """
    dead = [m for m in members if m.dead]
    peer_errors = [m for m in members if m.run_result and m.run_result.kind == "peer"]
    if peer_errors and not dead:
        # The first signal: a peer's collective failed. Ask the raylets of the ranks still
        # inside run() at once; a refused connection is proof that the node is gone. (A
        # connection that merely times out proves nothing yet: see below.)
        in_run = [m for m in members if m.run_result is None]
        gone = raylets.dead({m.node_id for m in in_run}, wait_s=0.0, refused_only=True)
        dead = [m for m in in_run if m.node_id in gone]
        first = min(m.returned_at for m in peer_errors)
        if not dead and now - first >= PEER_GRACE_S:
            # Silence alone is not death: a loaded machine can delay a poll. A suspect
            # counts as dead once its node's raylet is gone; a lone dead process on a live
            # node is confirmed by Ray within moments, and a hung one by the heartbeat.
            suspects = [m for m in members if m.run_result is None and now - m.last_ok >= PEER_GRACE_S]
            gone = raylets.dead({m.node_id for m in suspects}, wait_s=0.0)
            dead = [m for m in suspects if m.node_id in gone]
    if dead:
        lost_nodes = _lost_nodes(members, dead, raylets)
        cls: type[WorkerFailure] = NodeLost if lost_nodes else ActorDied
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
    errors = {m.rank: m.run_result for m in members if m.run_result and m.run_result.status == "error"}
    own = [r for r, res in errors.items() if res.kind == "worker_error"]
    if own and all(errors[r].loader_wait_s > 0 for r in own):  # their data loaders hung
        waited = max(errors[r].loader_wait_s for r in own)
        return LoaderStalled(errors[own[0]].detail, waited, ranks=own, nodes=_nodes_of(members, own))
    if own:
        cls = WorkerError if all(errors[r].retryable for r in own) else NotRetryable
        return cls(errors[own[0]].detail, ranks=own, nodes=_nodes_of(members, own))
    timeouts = [r for r, res in errors.items() if res.kind == "timeout"]
    if timeouts:
        hung = [m.rank for m in members if m.run_result is None]
        return CollectiveTimeout(
            f"a collective did not finish within {elastic.collective_timeout_s:g}s",
            ranks=hung or timeouts,
            nodes=_nodes_of(members, hung or timeouts),
        )
    if peer_errors and all(m.run_result is not None for m in members):
        # Every rank is out of run(), some with a collective error, and no peer is dead or
        # silent: an error of torch's own that looked like a collective's. The rank that
        # reported first (on the driver's clock) is blamed; it is re-formed, not evicted.
        first = min(peer_errors, key=lambda m: m.returned_at)
        if now - first.returned_at >= PEER_GRACE_S:
            return WorkerError(first.run_result.detail, ranks=[first.rank], nodes=[first.node_id])
    return None


def _lost_nodes(members: list[Any], dead: list[Any], raylets: RayletProbe) -> set[str]:
    """Nodes whose every member died and whose raylet no longer accepts connections."""
    dead_ids = {id(m) for m in dead}
    candidates = {m.node_id for m in dead}
    for m in members:  # one pass: a node with a live member is not lost
        if m.node_id in candidates and not (m.dead or id(m) in dead_ids):
            candidates.discard(m.node_id)
    if not candidates:
        return set()
    return raylets.dead(candidates, wait_s=NODE_PROBE_S)


def _nodes_of(members: list[Any], ranks: list[int]) -> list[str]:
    wanted = set(ranks)
    return sorted({m.node_id for m in members if m.rank in wanted})


class RayletProbe:
    """Is a node's raylet still there? Asked by TCP connection, the fastest evidence there is.

    Ray's node table can report a lost node alive for tens of seconds, while a connection to
    its raylet is refused at once. A refused connection is proof that the node is gone. A
    connection that merely times out is not: a loaded machine's raylet can be slow to
    accept. A node counts as dead on a timeout only after ``TIMEOUTS_TO_DEATH`` timeouts in
    a row (a probe with ``wait_s`` keeps probing until then).
    """

    CONNECT_TIMEOUT_S = 0.2
    TIMEOUTS_TO_DEATH = 3

    def __init__(self) -> None:
        self.addresses: dict[str, tuple[str, int]] = {}
        self._timeouts: dict[str, int] = {}

    def update(self, addresses: dict[str, tuple[str, int]]) -> None:
        self.addresses.update(addresses)

    def dead(self, node_ids: set[str], wait_s: float, refused_only: bool = False) -> set[str]:
        """The nodes among ``node_ids`` whose raylet is gone, probed for up to ``wait_s``.

        Every node is probed at once (non-blocking connects, one wait for them all), so a
        probe of many nodes costs one ``CONNECT_TIMEOUT_S`` at most, not one per node.
        ``refused_only``: only a refused connection counts, and a timeout is not tallied
        (for the eager probes made on the first peer error, which may ask a loaded live
        node several times in a row).
        """
        deadline = time.monotonic() + wait_s
        while True:
            dead = self._probe_all(node_ids, refused_only)
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _probe_all(self, node_ids: set[str], refused_only: bool) -> set[str]:
        targets = {n: self.addresses[n] for n in node_ids if n in self.addresses}
        answers = connect_all(targets, self.CONNECT_TIMEOUT_S)
        dead = set()
        for node, answer in answers.items():
            if answer == "refused":
                dead.add(node)
            elif answer == "timeout":
                if refused_only:
                    continue
                self._timeouts[node] = self._timeouts.get(node, 0) + 1
                if self._timeouts[node] >= self.TIMEOUTS_TO_DEATH:
                    dead.add(node)
            else:
                self._timeouts[node] = 0
        return dead


PROBE_BATCH = 512  # sockets open at once, well under the usual open-file limit


def connect_all(targets: dict[str, tuple[str, int]], timeout_s: float) -> dict[str, str]:
    """A TCP connection to every address at once: ``ok``, ``refused`` (nobody listens there:
    refused, reset, unreachable) or ``timeout``, by key. One wait of ``timeout_s`` at most
    per ``PROBE_BATCH`` addresses."""
    out: dict[str, str] = {}
    items = list(targets.items())
    for i in range(0, len(items), PROBE_BATCH):
        out.update(_connect_batch(items[i : i + PROBE_BATCH], timeout_s))
    return out


def _connect_batch(items: list[tuple[str, tuple[str, int]]], timeout_s: float) -> dict[str, str]:
    out: dict[str, str] = {}
    waiting: dict[socket.socket, str] = {}
    with selectors.DefaultSelector() as sel:
        try:
            for key, addr in items:
                try:
                    sock = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_STREAM)
                except OSError:
                    out[key] = "timeout"  # out of sockets here: proves nothing about the node
                    continue
                sock.setblocking(False)
                err = sock.connect_ex(addr)
                if err in (0, errno.EISCONN):
                    out[key] = "ok"
                    sock.close()
                elif err in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK, errno.EAGAIN):
                    waiting[sock] = key
                    sel.register(sock, selectors.EVENT_WRITE)
                else:
                    out[key] = "refused"
                    sock.close()
            deadline = time.monotonic() + timeout_s
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for sk, _ in sel.select(left):
                    sock = cast(socket.socket, sk.fileobj)  # what was registered: a socket of ``waiting``
                    sel.unregister(sock)
                    key = waiting.pop(sock)
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    out[key] = "ok" if err == 0 else "refused"
                    sock.close()
            for key in waiting.values():
                out[key] = "timeout"
        finally:
            for sock in waiting:
                sock.close()
    return out
