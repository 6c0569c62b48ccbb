"""Carrying out a ``ReformPlan`` on Ray: every rank's ``ConfigureRequest`` built first, then
all sent in one command down the agent tree, then gathered (driver side;
``WorkerGroup.reform`` calls it, through the group's ``GroupPoll``).

Building every request before sending any keeps the first and the last rank's arrival at
the rendezvous apart by the tree's fan-out only, not by the planning work: with the
planning inside the submission loop, that gap grew as N² and reached the rendezvous
timeout at a few thousand ranks. The driver sends one call per channel of the tree, not
one per rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from elastic.control.recovery_plan import ReformPlan
from elastic.control.worker_group.api import ConfigureResult
from elastic.errors import NodeResourceError, RendezvousFailed, WorkerError, WorkerFailure
from elastic.errors import root_cause as _root_cause
from elastic.messages import AbandonRendezvous, ConfigureRequest, MemoryRestore, NodeConfigure, Signal, StorageRestore

if TYPE_CHECKING:
    from elastic.control.worker_group.poll import GroupPoll
    from elastic.control.worker_group.worker import Member

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 120.0
# A rank's configure error that says the generation did not form, not that its code failed:
# torch's rendezvous and connection errors, a rank that joined after the driver abandoned
# the generation, and ranks that did not answer.
RENDEZVOUS_ERRORS = (
    "DistError:",
    "DistStoreError:",
    "DistNetworkError:",
    "DistBackendError:",
    "AbandonedRendezvous:",
    "GetTimeoutError:",
    "TimeoutError:",
)


def build_requests(
    plan: ReformPlan[Member],
    *,
    generation: int,
    dims: tuple[int, int, int],
    store: tuple[str, int],
    storage_uri: str,
    storage_options: dict[str, Any],
    read_plans: Sequence[dict[str, Any] | None],
    store_secret: str = "",
) -> list[ConfigureRequest]:
    """One request per rank of ``plan`` (``plan.members[r]`` is rank r)."""
    members, restore = plan.members, plan.restore
    hosts: dict[str, int] = {}
    for m in members:
        hosts.setdefault(m.node_id, len(hosts))
    requests = []
    for rank, m in enumerate(members):
        how: MemoryRestore | StorageRestore | None = None
        if restore.source == "memory" and restore.step is not None:
            holders = {o: (None if h is None else h.actor) for o, h in plan.owners[rank].items()}
            how = MemoryRestore(restore.step, holders)
        elif restore.source == "storage" and restore.step is not None:
            how = StorageRestore(restore.step, storage_uri, storage_options)
        peer = plan.peers[rank]
        kept = plan.regroup[rank] if plan.regroup else None
        requests.append(
            ConfigureRequest(
                generation=generation,
                rank=rank,
                dims=dims,
                store=store,
                step=plan.step,
                host_index=hosts[m.node_id],
                restore=how,
                storage_uri=storage_uri,
                replica_peer=members[peer].actor if peer is not None else None,  # keeps copies of m's snapshots
                read_plan=read_plans[rank],
                store_secret=store_secret,
                prior_rank=kept.prior_rank if kept else None,
                keep_state=kept.keep_state if kept else False,
                unchanged_groups=kept.unchanged_groups if kept else (),
                shrink_excluded=kept.shrink_excluded if kept else None,
            )
        )
    return requests


def reconfigure_ranks(
    poll: GroupPoll,
    members: Sequence[Member],
    requests: Sequence[ConfigureRequest],
    generation: int,
    timeout_s: float,
    lost_failure: Callable[[Sequence[Member], str], WorkerFailure],
    sent_at: list[float],
) -> ConfigureResult:
    """Send every request down the agent tree in one command (one call per channel, each
    node's requests together), then gather every rank's reply; a member lost meanwhile
    becomes a typed failure (``lost_failure(members, when)``); ``sent_at`` gets the driver
    clock once every request is on its way.

    As soon as one member is lost or fails, the generation is abandoned: every member
    still configuring is told so (``abandon_rendezvous``, answered by its control thread
    while the rendezvous blocks its train thread), and fails at once rather than after
    the timeout. Peers blocked on the lost one in a collective are freed by its process
    dying, or by its leaving the group. They stay members, and the next recovery
    re-forms them as a new generation on the same store.
    """
    parts: dict[str, dict[int, ConfigureRequest]] = {}
    for m, req in zip(members, requests):
        parts.setdefault(m.node_id, {})[m.wid] = req
    expect = {node: set(reqs) for node, reqs in parts.items()}
    g = poll.command({node: NodeConfigure(reqs) for node, reqs in parts.items()}, expect)
    sent_at.append(time.monotonic())  # every request is on its way (benchmarks/control_plane.py)
    for m in members:
        m.since = g.cid
    poll.wait_for(g, timeout_s + RPC_TIMEOUT_S, until_failure=True)
    if g.failed() and not g.complete():
        logger.info("generation %d abandoned: a member was lost or failed while it formed", generation)
        poll.tree.send(dict.fromkeys(expect, Signal(AbandonRendezvous(generation))))
        poll.wait_for(g, timeout_s + RPC_TIMEOUT_S)
    poll.done(g)
    by_wid = {m.wid: m for m in members}
    lost = [by_wid[w] for w in sorted(g.lost)]
    for m in lost:
        m.dead = True
    failed = [(by_wid[w], err) for w, err in sorted(g.errors.items())]
    silent = [by_wid[w] for w in sorted(g.missing())]
    nodes = len({m.node_id for m in silent})
    failed += [(m, f"GetTimeoutError: no answer from {len(silent)} rank(s) on {nodes} node(s)") for m in silent]
    if lost or failed:
        failure = lost_failure(lost, "lost while reconfiguring") if lost else _configure_failure(g, failed)
        failure.unanswered = [m.rank for m in silent]
        raise failure
    ordered = [g.replies[m.wid] for m in members]
    for m, r in zip(members, ordered):
        m.connections = r.connections  # its peers cut their ends of these when it is lost
    return ConfigureResult(
        step=ordered[0].step,
        init_s=max(r.init_s for r in ordered),
        build_s=max(r.build_s for r in ordered),
        restore_s=max(r.restore_s for r in ordered),
        restore_bytes_read=sum(r.restore_bytes_read for r in ordered),
        store_ops_per_rank=max(r.store_ops for r in ordered),
        ranks_kept_state=sum(r.kept_state for r in ordered),
        peer_bytes=sum(r.peer_bytes for r in ordered),
        cpu_s=max(r.cpu_s for r in ordered),
    )


def _configure_failure(g: Any, failed: list[tuple[Member, str]]) -> WorkerFailure:
    """The failure of a configure that lost no member: whose fault its errors say it was."""
    # A node that failed its ranks for its own sake (a full disk) is named alone: the
    # failure counts against it (elastic.lemon_failures), not against the training code.
    faulty = [(m, err) for m, err in failed if m.wid in g.node_faults]
    blamed = faulty or failed
    rendezvous = all(err.startswith(RENDEZVOUS_ERRORS) for _, err in failed)
    return (NodeResourceError if faulty else RendezvousFailed if rendezvous else WorkerError)(
        f"configure failed: {blamed[0][1]}",
        ranks=[m.rank for m, _ in blamed],
        nodes=sorted({m.node_id for m, _ in blamed}),
    )


def root_cause(exc: BaseException) -> str:
    """One line naming the exception a worker really raised (``elastic.errors.root_cause``)."""
    return _root_cause(exc)


def lost_failure_of(raylets: Any, probe_s: float):
    """``lost_failure(members, when)``: ``node_lost`` when the lost members' raylets are gone
    too, else ``actor_died``."""
    from elastic.errors import ActorDied, NodeLost

    def lost_failure(lost: Sequence[Member], when: str) -> WorkerFailure:
        nodes = {m.node_id for m in lost}
        gone = raylets.dead(nodes, wait_s=probe_s)
        cls = NodeLost if gone else ActorDied
        detail = f"{len(lost)} worker(s) {when}" + (f"; node(s) {sorted(gone)} left the cluster" if gone else "")
        return cls(detail, ranks=[m.rank for m in lost], nodes=sorted(nodes))

    return lost_failure
