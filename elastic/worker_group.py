"""The worker group: the Ray-effectful half of the controller.

It owns the actors, their placement groups and the job's rendezvous store, launches
training, turns what it sees (polls, returned errors, dead actors, raylets that refuse
connections) into typed ``WorkerFailure``s, and carries out the controller's decisions:
evict ranks, re-form the survivors as a new generation of the process group, add new
replicas and restore state. It decides nothing: what to keep, in which order and from which
snapshots comes from ``elastic/recovery_plan.py``; whether to retry and at what DP from
``elastic/policies.py``. ``elastic/worker_group_api.py`` is the interface the controller
uses, which the tests' fake group implements too.

Longer than the ~350 lines we aim for: every Ray call the controller makes is here, in one
place, on purpose; the pure parts are in ``elastic/recovery_plan.py`` and ``elastic/diagnosis.py``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from elastic import recovery_plan as plan
from elastic.diagnosis import NODE_PROBE_S, RayletProbe, diagnose
from elastic.errors import ActorDied, NodeLost, WorkerError, WorkerFailure
from elastic.ingest.host_readers import HostReaders
from elastic.messages import (
    DEAD,
    ConfigureReply,
    ConfigureRequest,
    MemoryRestore,
    RunOutcome,
    StorageRestore,
    WorkerInfo,
    WorkerReport,
)
from elastic.placement import ReplicaSlots
from elastic.topology_placement import PlannedSlots, placement_fields
from elastic.worker import TrainWorker
from elastic.worker.hooks import StepHook
from elastic.worker.process_group import RendezvousStore

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1  # how often the controller looks at (and polls) the group
RPC_TIMEOUT_S = 120.0


@dataclass
class Member:
    actor: Any
    group: Any  # placement group
    bundle: int
    node_id: str
    ip: str
    pid: int
    rank: int = -1
    last_ok: float = field(default_factory=time.monotonic)  # driver clock: its last poll answer
    poll_ref: Any = None
    run_ref: Any = None
    run_result: RunOutcome | None = None
    returned_at: float = 0.0  # driver clock: when its run() result arrived
    dead: bool = False
    step: int = 0


@dataclass
class Observation:
    """What one look at the group found."""

    results: list[tuple[int, WorkerReport]] = field(default_factory=list)  # (rank, report)
    failure: WorkerFailure | None = None
    finished: bool = False
    stopped: bool = False


class WorkerGroup:
    planned_placement = True  # docs/placement.md; False: the old one PACK group per replica, in Ray's order

    def __init__(self, spec: Any, corpus_uri: str, step_hook: StepHook | None = None, storage_uri: str = ""):
        self.spec = spec
        self.corpus_uri = corpus_uri
        self.readers = HostReaders(spec, corpus_uri)  # one data reader per reading host (docs/data.md)
        self.storage_uri = storage_uri  # where the storage tier writes ("" for none)
        self.step_hook = step_hook
        self.replica_size = spec.parallel.replica_size
        self.raylets = RayletProbe()  # node id -> raylet address, for liveness probes
        if self.planned_placement:
            self.slots: ReplicaSlots = PlannedSlots(spec, self.raylets)
        else:
            self.slots = ReplicaSlots(spec.resources, self.replica_size, spec.parallel.tp, spec.parallel.pp)
        self.members: list[Member] = []  # ordered by rank
        self.dp = 0
        self._store: RendezvousStore | None = None  # the job's rendezvous, made at the first configure
        self._generation = 0  # of the process group: the rendezvous key prefix
        self._node_labels: dict[str, dict[str, str]] = {}  # node id -> Ray node labels (rack, nvlink_domain)
        self._avoid_nodes: set[str] = set()  # node ids Ray is draining (elastic/drain.py)

    # ------------------------------------------------------------------ capacity
    def request_capacity(self) -> None:
        self.slots.request(self.spec.elastic.max_dp)

    def exclude_nodes(self, nodes: list[str]) -> None:
        """Lemon nodes (docs/health.md): no replica is placed on them again in this job."""
        # Workers already there stay until they fail or are evicted: only new placements avoid them.
        self.slots.exclude(set(nodes), keep={id(m.group) for m in self.members if not m.dead})
        self.request_capacity()

    @property
    def avoid_nodes(self) -> set[str]:
        """Node ids Ray is draining: no replica is planned or grown there until they stop draining."""
        return self._avoid_nodes

    @avoid_nodes.setter
    def avoid_nodes(self, nodes: set[str]) -> None:
        nodes = set(nodes)
        if nodes == self._avoid_nodes:
            return
        self._avoid_nodes = nodes
        avoid = getattr(self.slots, "avoid", None)
        if avoid is not None:  # planned placement: re-plan without them (live groups stay)
            avoid(nodes, keep={id(m.group) for m in self.members if not m.dead})

    def spare_groups(self, timeout: float = 0.0) -> list[Any]:
        """Ready placement groups that host no member: capacity to grow into."""
        used = {id(m.group) for m in self.members}
        spare = [g for g in self.slots.ready(timeout) if id(g) not in used]
        if self.avoid_nodes:  # draining nodes are not grown into (elastic/drain.py)
            spare = [g for g in spare if not group_nodes(g) & self.avoid_nodes]
        return spare

    def wait_spare(self, count: int, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        while True:
            spare = self.spare_groups(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            if len(spare) >= count or time.monotonic() >= deadline:
                return spare

    def spawn(self, groups: list[Any]) -> list[Member]:
        """Create one actor per bundle of each placement group (a whole replica each)."""
        actors = []
        # The step hook goes to the first workers only: an injected fault fires once per
        # job, not again in a replacement that replays the step.
        hook, self.step_hook = self.step_hook, None
        for g in groups:
            for b in range(self.replica_size):
                opts = self.slots.actor_options(g, b)
                actors.append((g, b, TrainWorker.options(**opts).remote(self.spec, self.corpus_uri, hook)))
        try:
            infos: list[WorkerInfo] = ray.get([a.info.remote() for _, _, a in actors], timeout=RPC_TIMEOUT_S)
        except (RayActorError, ActorUnavailableError, GetTimeoutError) as exc:
            # A new node died (or never started its workers): none of these become members.
            for _, _, a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception as kill_exc:  # already gone with its node
                    logger.debug("kill of a new worker failed: %s", kill_exc)
            raise ActorDied(f"a new worker was lost while starting: {type(exc).__name__}", ranks=[], nodes=[]) from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.raylets.update({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"]) for n in nodes})
        self._node_labels.update({n["NodeID"]: dict(n.get("Labels") or {}) for n in nodes})
        return [Member(a, g, b, i.node_id, i.ip, i.pid) for (g, b, a), i in zip(actors, infos)]

    # ------------------------------------------------------------------ (re)configuration
    def configure(
        self, members: list[Member], dp: int, step: int, restore_step: int | None, source: str
    ) -> dict[str, float]:
        """Give ``members`` ranks 0..n-1, form a new generation of the group and restore state.

        ``source``: ``memory`` (snapshots of ``restore_step`` held by the old members),
        ``storage`` (the checkpoint of ``restore_step``) or ``none`` (start at ``step``).
        """
        tp, pp, zero = self.spec.parallel.tp, self.spec.parallel.pp, self.spec.parallel.zero
        ep, cp = self.spec.parallel.ep, self.spec.parallel.cp
        old_holders = self._snapshot_holders(restore_step) if source == "memory" else {}
        members = self.rank_order(members)
        for rank, m in enumerate(members):
            m.rank, m.run_ref, m.run_result, m.poll_ref = rank, None, None, None
        # From here on these are the members: a loss below is a failure of this layout,
        # and the next recovery evicts it by its new rank (newcomers are not leaked).
        self.members = list(members)
        if self._store is None:
            self._store = RendezvousStore(ray.util.get_node_ip_address(), self.spec.elastic.collective_timeout_s)
        self._generation += 1
        generation = self._generation
        hosts = _host_indices(members)
        reads = self.readers.plans([m.node_id for m in members], generation)  # docs/data.md
        peers = [None] * len(members)
        if self.spec.checkpoint.replicate:
            peers = plan.replica_peers([m.node_id for m in members], tp, pp, zero, ep=ep, cp=cp)
        refs = []
        for m, peer, read_plan in zip(members, peers, reads):
            restore = None
            if source == "memory":
                owners = plan.owners_for(m.rank, old_holders, m, tp, pp, zero, ep=ep, cp=cp)
                holders = {o: (None if h is None else h.actor) for o, h in owners.items()}
                restore = MemoryRestore(restore_step, holders)
            elif source == "storage":
                restore = StorageRestore(restore_step, self.storage_uri, self.spec.checkpoint.storage_options)
            req = ConfigureRequest(
                generation=generation,
                rank=m.rank,
                dims=(dp, tp, pp),
                store=self._store.address,
                step=step,
                host_index=hosts[m.node_id],
                restore=restore,
                storage_uri=self.storage_uri,
                replica_peer=members[peer].actor if peer is not None else None,  # keeps copies of m's snapshots
                read_plan=read_plan,
            )
            refs.append(m.actor.configure.remote(req))
        replies = self._gather_configure(members, refs)
        self.dp = dp
        now = time.monotonic()
        for m, r in zip(members, replies):
            m.last_ok, m.step = now, r.step
        return {
            "init_s": max(r.init_s for r in replies),
            "build_s": max(r.build_s for r in replies),
            "restore_s": max(r.restore_s for r in replies),
            "restore_bytes_read": sum(r.restore_bytes_read for r in replies),  # from storage, all ranks
            "step": replies[0].step,
        }

    def rank_order(self, members: list[Member]) -> list[Member]:
        """Whole replicas ordered rack by rack (``recovery_plan.rank_order``)."""
        labels = self._node_labels
        return plan.rank_order(members, self.replica_size, lambda node: labels.get(node, {}).get("rack", ""))

    def _gather_configure(self, members: list[Member], refs: list[Any]) -> list[ConfigureReply]:
        """Wait for every configure; a member lost meanwhile becomes a new typed failure.

        As soon as one member is lost or fails, the generation is abandoned: every member
        still configuring is told so (``abandon_rendezvous``, answered by its control thread
        while the rendezvous blocks its train thread), and fails at once rather than after
        the timeout. Peers blocked on the lost one in a collective are freed by its process
        dying, or by its leaving the group. They stay members, and the next recovery
        re-forms them as a new generation on the same store.
        """
        pending = dict(zip(refs, members))
        deadline = time.monotonic() + self.spec.elastic.collective_timeout_s + RPC_TIMEOUT_S
        replies: dict[int, ConfigureReply] = {}
        lost, failed = [], []
        abandoned = False
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                m = pending.pop(ref)
                try:
                    replies[m.rank] = ray.get(ref, timeout=0)
                except (RayActorError, ActorUnavailableError):
                    m.dead = True
                    lost.append(m)
                except Exception as exc:  # an error inside configure
                    failed.append((m, exc))
            if (lost or failed) and not abandoned:
                abandoned = True
                logger.info("generation %d abandoned: a member was lost while it formed", self._generation)
                for m in pending.values():
                    m.actor.abandon_rendezvous.remote(self._generation)
        failed += [(m, GetTimeoutError("no answer")) for m in pending.values()]
        if lost:
            raise self._lost_failure(lost, "lost while reconfiguring")
        if failed:
            m, exc = failed[0]
            raise WorkerError(
                f"configure failed: {type(exc).__name__}: {str(exc)[:300]}",
                ranks=[m.rank for m, _ in failed],
                nodes=sorted({m.node_id for m, _ in failed}),
            )
        return [replies[m.rank] for m in members]

    def _lost_failure(self, lost: list[Member], when: str) -> WorkerFailure:
        """``node_lost`` when the lost members' raylets are gone too, else ``actor_died``."""
        nodes = {m.node_id for m in lost}
        gone = self.raylets.dead(nodes, wait_s=NODE_PROBE_S)
        cls = NodeLost if gone else ActorDied
        detail = f"{len(lost)} worker(s) {when}" + (f"; node(s) {sorted(gone)} left the cluster" if gone else "")
        return cls(detail, ranks=[m.rank for m in lost], nodes=sorted(nodes))

    def _snapshot_holders(self, step: int | None) -> dict[int, Member]:
        """Old rank -> a live member holding that rank's snapshot at ``step``."""
        live = [m for m in self.members if not m.dead]
        return plan.holders_at(list(zip(live, self._query_snapshots(live))), step)

    def _query_snapshots(self, members: list[Member]) -> list[dict[int, list[int]] | None]:
        """Each member's snapshot holdings; None for one that is gone or silent (10 s in all).

        Members on a node whose raylet refuses connections are not asked: a call to an
        actor on a lost node can hang until Ray notices the loss.
        """
        gone = self.raylets.dead({m.node_id for m in members}, wait_s=0.0)
        refs = [None if m.node_id in gone else m.actor.snapshot_holdings.remote() for m in members]
        asked = [r for r in refs if r is not None]
        if asked:
            ray.wait(asked, num_returns=len(asked), timeout=10)
        out = []
        for ref in refs:
            try:
                out.append(None if ref is None else ray.get(ref, timeout=0))
            except (RayActorError, ActorUnavailableError, GetTimeoutError):
                out.append(None)
        return out

    def common_snapshot_step(self, members: list[Member]) -> int | None:
        """Newest step whose snapshots, held by ``members``, cover the whole current layout."""
        p = self.spec.parallel
        world = self.dp * p.replica_size
        return plan.covering_step(self._query_snapshots(members), world, p.tp, p.pp, p.zero, ep=p.ep, cp=p.cp)

    # ------------------------------------------------------------------ running
    def launch(self, last_step: int) -> None:
        for m in self.members:
            m.run_ref = m.actor.run.remote(last_step)
            m.run_result = None

    def observe(self, timeout: float = POLL_INTERVAL_S) -> Observation:
        obs = Observation()
        running = [m for m in self.members if m.run_ref is not None and m.run_result is None]
        for m in self.members:
            if m.poll_ref is None and not m.dead:
                m.poll_ref = m.actor.poll.remote(POLL_INTERVAL_S)  # a long poll: back with the next report
        polls = [m.poll_ref for m in self.members if m.poll_ref is not None]
        runs = [m.run_ref for m in running]
        if runs:
            # Back as soon as any rank leaves run() (a failure is seen at once) or a poll
            # brings a report; other polls answered meanwhile are read now or at the next look.
            ray.wait(runs + polls, num_returns=1, timeout=timeout)
        elif polls:
            ray.wait(polls, num_returns=len(polls), timeout=timeout)
        now = time.monotonic()
        for m in self.members:
            self._read_poll(m, obs, now)
            self._read_run(m)
        obs.failure = diagnose(self.members, self.spec.elastic, now, self.raylets)
        if obs.failure is None and self.members and all(m.run_result is not None for m in self.members):
            self._drain(obs)
            statuses = {m.run_result.status for m in self.members}
            obs.finished = statuses == {"done"}
            obs.stopped = "stopped" in statuses and statuses <= {"stopped", "done"}
        return obs

    def _drain(self, obs: Observation, members: list[Member] | None = None, timeout: float = RPC_TIMEOUT_S) -> None:
        """Collect the results ``members`` (default: all) produced since their last poll.

        Two rounds, all members at once: the poll in flight (or a new one), then a fresh one
        for each member that answered, for what it reported meanwhile. A member that does
        not answer within ``timeout`` is left for the next look.
        """
        todo = [m for m in (members if members is not None else self.members) if not m.dead]
        for _ in range(2):
            for m in todo:
                if m.poll_ref is None:
                    m.poll_ref = m.actor.poll.remote()
            refs = [m.poll_ref for m in todo]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=timeout)
            now = time.monotonic()
            for m in todo:
                self._read_poll(m, obs, now)
            todo = [m for m in todo if m.poll_ref is None and not m.dead]  # answered: ask once more

    def drain_results(self, members: list[Member], timeout: float = 10.0) -> list[tuple[int, WorkerReport]]:
        """Results that survivors reported but the controller has not seen yet."""
        obs = Observation()
        self._drain(obs, members, timeout)
        return obs.results

    def _read_poll(self, m: Member, obs: Observation, now: float) -> None:
        if m.poll_ref is None:
            return
        ready, _ = ray.wait([m.poll_ref], timeout=0)
        if not ready:
            return
        ref, m.poll_ref = m.poll_ref, None
        try:
            reply = ray.get(ref)
        except ActorUnavailableError:  # unreachable for now: silence counts, death is confirmed later
            return
        except RayActorError:
            m.dead = True
            return
        m.last_ok, m.step = now, reply.step
        obs.results.extend((m.rank, r) for r in reply.reports)

    def _read_run(self, m: Member) -> None:
        if m.run_ref is None or m.run_result is not None:
            return
        ready, _ = ray.wait([m.run_ref], timeout=0)
        if ready:
            try:
                m.run_result = ray.get(m.run_ref)
            except ActorUnavailableError:
                return
            except RayActorError:
                m.dead = True
                m.run_result = DEAD
            m.returned_at = time.monotonic()

    def request_stop(self) -> None:
        for m in self.members:
            m.actor.request_stop.remote()

    def wait_runs(self, members: list[Member], timeout: float) -> list[Member]:
        """Wait for ``members``' run() calls to return; returns those that did not."""
        refs = {m.run_ref: m for m in members if m.run_ref is not None and m.run_result is None}
        if refs:
            ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        for m in members:
            self._read_run(m)
        return [m for m in members if m.run_ref is not None and m.run_result is None]

    def kill(self, members: list[Member]) -> None:
        for m in members:
            m.dead = True
            try:
                ray.kill(m.actor, no_restart=True)
            except Exception as exc:  # already dead
                logger.debug("kill of rank %s failed: %s", m.rank, exc)

    def complete_replicas(self, members: list[Member]) -> list[list[Member]]:
        """Survivors grouped into whole replicas (old DP rank), each in rank order."""
        return plan.complete_replicas(members, self.replica_size)

    def release_group(self, group: Any) -> None:
        self.slots.release(group)

    def placement(self) -> dict[str, Any]:
        """The ``placement`` event's fields for the current members (docs/outputs.md)."""
        p = self.spec.parallel
        return placement_fields(self.dp, p.tp, p.pp, self.members, self._node_labels, ep=p.ep, cp=p.cp)

    def pid_of(self, rank: int) -> int:
        return next(m.pid for m in self.members if m.rank == rank)

    def pids_on_node(self, node_id: str) -> list[int]:
        return [m.pid for m in self.members if m.node_id == node_id]

    def shutdown(self) -> None:
        self.kill([m for m in self.members if not m.dead])
        self.readers.close()
        self.slots.release_all()
        if self._store is not None:
            self._store.close()
            self._store = None


def group_nodes(group: Any) -> set[str]:
    """The node ids a placement group's bundles are on."""
    from ray.util.placement_group import placement_group_table

    return set((placement_group_table(group).get("bundles_to_node_id") or {}).values())


def _host_indices(members: list[Member]) -> dict[str, int]:
    order: dict[str, int] = {}
    for m in members:
        order.setdefault(m.node_id, len(order))
    return order
