"""The worker group: the Ray-effectful half of the controller.

It owns the actors and their placement groups, launches training, turns what it sees
(polls, returned errors, dead actors, Ray's node table) into typed ``WorkerFailure``s, and
carries out the controller's decisions: evict ranks, re-rendezvous the survivors on a fresh
port, add new replicas and restore state. It decides nothing about *whether* to retry or
*what* DP to run at; that is the pure policies' job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from elastic import policies
from elastic.diagnosis import NODE_PROBE_S, diagnose, probe_dead_nodes
from elastic.errors import ActorDied, NodeLost, WorkerError, WorkerFailure
from elastic.ingest.feeder import read_plans
from elastic.placement import ReplicaSlots
from elastic.worker import TrainWorker

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
    last_ok: float = field(default_factory=time.monotonic)
    poll_ref: Any = None
    run_ref: Any = None
    run_result: dict[str, Any] | None = None
    dead: bool = False
    step: int = 0


@dataclass
class Observation:
    """What one look at the group found."""

    results: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (rank, result)
    failure: WorkerFailure | None = None
    finished: bool = False
    stopped: bool = False


class WorkerGroup:
    def __init__(self, spec: Any, corpus_uri: str, worker_faults: list[dict] | None = None):
        self.spec = spec
        self.corpus_uri = corpus_uri
        self.worker_faults = worker_faults or []
        self.replica_size = spec.parallel.replica_size
        self.slots = ReplicaSlots(spec.resources, self.replica_size, spec.parallel.tp, spec.parallel.pp)
        self.members: list[Member] = []  # ordered by rank
        self.dp = 0
        self._raylets: dict[str, tuple[str, int]] = {}  # node id -> raylet address, for liveness probes
        self._node_labels: dict[str, dict[str, str]] = {}  # node id -> Ray node labels (rack, nvlink_domain)

    # ------------------------------------------------------------------ capacity
    def request_capacity(self) -> None:
        self.slots.request(self.spec.elastic.max_dp)

    def spare_groups(self, timeout: float = 0.0) -> list[Any]:
        """Ready placement groups that host no member: capacity to grow into."""
        used = {id(m.group) for m in self.members}
        return [g for g in self.slots.ready(timeout) if id(g) not in used]

    def wait_spare(self, count: int, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        while True:
            spare = self.spare_groups(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            if len(spare) >= count or time.monotonic() >= deadline:
                return spare

    def spawn(self, groups: list[Any]) -> list[Member]:
        """Create one actor per bundle of each placement group (a whole replica each)."""
        actors = []
        # Injected worker faults go to the first workers only: each fires once per job,
        # not again in a replacement that replays the step.
        faults, self.worker_faults = self.worker_faults, []
        for g in groups:
            for b in range(self.replica_size):
                opts = self.slots.actor_options(g, b)
                actors.append((g, b, TrainWorker.options(**opts).remote(self.spec, self.corpus_uri, faults)))
        try:
            infos = ray.get([a.info.remote() for _, _, a in actors], timeout=RPC_TIMEOUT_S)
        except (RayActorError, ActorUnavailableError, GetTimeoutError) as exc:
            # A new node died (or never started its workers): none of these become members.
            for _, _, a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception as kill_exc:  # already gone with its node
                    logger.debug("kill of a new worker failed: %s", kill_exc)
            raise ActorDied(f"a new worker was lost while starting: {type(exc).__name__}", ranks=[], nodes=[]) from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self._raylets.update({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"]) for n in nodes})
        self._node_labels.update({n["NodeID"]: dict(n.get("Labels") or {}) for n in nodes})
        return [Member(a, g, b, i["node_id"], i["ip"], i["pid"]) for (g, b, a), i in zip(actors, infos)]

    # ------------------------------------------------------------------ (re)configuration
    def configure(
        self, members: list[Member], dp: int, start: dict[str, Any], restore_step: int | None, source: str
    ) -> dict[str, float]:
        """Give ``members`` ranks 0..n-1, rendezvous on a fresh port and restore state."""
        tp, pp = self.spec.parallel.tp, self.spec.parallel.pp
        old_holders = self._snapshot_holders(restore_step) if source == "memory" else {}
        members = self.rank_order(members)
        for rank, m in enumerate(members):
            m.rank, m.run_ref, m.run_result, m.poll_ref = rank, None, None, None
        # From here on these are the members: a loss below is a failure of this layout,
        # and the next recovery evicts it by its new rank (newcomers are not leaked).
        self.members = list(members)
        try:
            port = ray.get(members[0].actor.free_port.remote(), timeout=RPC_TIMEOUT_S)
        except (RayActorError, ActorUnavailableError, GetTimeoutError):
            self.kill([members[0]])  # unreachable: evicted like a dead one
            raise self._lost_failure([members[0]], "lost before the rendezvous") from None
        hosts = _host_indices(members)
        plans = read_plans(
            self.spec, self.corpus_uri, [m.node_id for m in members], port
        )  # data feeders (docs/data.md)
        peers = [None] * len(members)
        if self.spec.checkpoint.replicate:
            peers = policies.replica_peers([m.node_id for m in members], tp, pp, self.spec.parallel.zero)
        refs = []
        for m, peer, plan in zip(members, peers, plans):
            restore = None
            if source == "memory":
                restore = {"source": "memory", "step": restore_step, "holders": self._holders_for(m, old_holders)}
            elif source == "storage":
                restore = {
                    "source": "storage",
                    "step": restore_step,
                    "uri": self.storage_uri,
                    "storage_options": self.spec.checkpoint.storage_options,
                }
            start_m = dict(start, storage_uri=self.storage_uri, read_plan=plan, hosts=len(hosts))
            start_m["replica_peer"] = members[peer].actor if peer is not None else None  # keeps copies of m's snapshots
            refs.append(
                m.actor.configure.remote(
                    m.rank, (dp, tp, pp), (members[0].ip, port), start_m, restore, hosts[m.node_id]
                )
            )
        replies = self._gather_configure(members, refs)
        self.dp = dp
        now = time.monotonic()
        for m, r in zip(members, replies):
            m.last_ok, m.step = now, r["step"]
        return {
            "init_s": max(r["init_s"] for r in replies),
            "build_s": max(r["build_s"] for r in replies),
            "restore_s": max(r["restore_s"] for r in replies),
            "restore_bytes_read": sum(r.get("restore_bytes_read", 0) for r in replies),  # from storage, all ranks
            "step": replies[0]["step"],
        }

    storage_uri: str = ""

    def rank_order(self, members: list[Member]) -> list[Member]:
        """Whole replicas (consecutive chunks of ``members``) ordered rack by rack, then by node.

        DP ranks follow replica order, so the DP ring visits each rack's replicas
        together and crosses racks as few times as possible. Inside a replica the order is
        kept (TP fastest, then PP), matching the mesh ``("dp", "pp", "tp")``.
        """
        size = self.replica_size
        replicas = [members[i : i + size] for i in range(0, len(members), size)]
        labels = self._node_labels

        def key(replica: list[Member]) -> tuple[str, str]:
            node = replica[0].node_id
            return (labels.get(node, {}).get("rack", ""), node)

        replicas.sort(key=key)
        return [m for r in replicas for m in r]

    def _gather_configure(self, members: list[Member], refs: list[Any]) -> list[dict[str, Any]]:
        """Wait for every configure; a member lost meanwhile becomes a new typed failure.

        Peers of a lost member wait in the rendezvous until its timeout
        (``collective_timeout_s``) and then fail too; they stay members, so the next
        recovery reconfigures them.
        """
        timeout = self.spec.elastic.collective_timeout_s + RPC_TIMEOUT_S
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        replies, lost, failed = [], [], []
        for m, ref in zip(members, refs):
            try:
                replies.append(ray.get(ref, timeout=0))
            except (RayActorError, ActorUnavailableError):
                m.dead = True
                lost.append(m)
            except Exception as exc:  # an error inside configure, or no answer in time
                failed.append((m, exc))
        if lost:
            raise self._lost_failure(lost, "lost while reconfiguring")
        if failed:
            m, exc = failed[0]
            raise WorkerError(
                f"configure failed: {type(exc).__name__}: {str(exc)[:300]}",
                ranks=[m.rank for m, _ in failed],
                nodes=sorted({m.node_id for m, _ in failed}),
            )
        return replies

    def _lost_failure(self, lost: list[Member], when: str) -> WorkerFailure:
        """``node_lost`` when the lost members' raylets are gone too, else ``actor_died``."""
        nodes = {m.node_id for m in lost}
        gone = probe_dead_nodes(nodes, self._raylets, wait_s=NODE_PROBE_S)
        cls = NodeLost if gone else ActorDied
        detail = f"{len(lost)} worker(s) {when}" + (f"; node(s) {sorted(gone)} left the cluster" if gone else "")
        return cls(detail, ranks=[m.rank for m in lost], nodes=sorted(nodes))

    def _snapshot_holders(self, step: int | None) -> dict[int, Member]:
        """Old rank -> a live member holding that rank's snapshot at ``step``."""
        held: dict[int, Member] = {}
        live = [m for m in self.members if not m.dead]
        for m, info in zip(live, self._query_snapshots(live)):
            for owner, steps in (info or {}).items():
                if step in steps and (int(owner) not in held or int(owner) == m.rank):
                    held[int(owner)] = m
        return held

    def _holders_for(self, m: Member, holders: dict[int, Member]) -> dict[int, Any]:
        """Old ranks whose snapshots ``m`` must read (None where it holds one itself).

        ``m`` needs the shards of its own (pp, tp) coordinate: one DP replica's copy under
        DDP (its own if it has one), every DP shard under FSDP (to reshard them).
        """
        tp, pp = self.spec.parallel.tp, self.spec.parallel.pp

        def coord(rank: int) -> tuple[int, int]:
            return ((rank // tp) % pp, rank % tp)

        mine = {o: h for o, h in holders.items() if coord(o) == coord(m.rank)}
        if self.spec.parallel.zero == 0 and mine:
            owner = next((o for o, h in mine.items() if h is m), next(iter(mine)))
            mine = {owner: mine[owner]}
        return {owner: (None if h is m else h.actor) for owner, h in mine.items()}

    def _query_snapshots(self, members: list[Member]) -> list[dict[int, list[int]] | None]:
        """Each member's snapshot holdings; None for one that is gone or silent (10 s in all).

        Members on a node whose raylet refuses connections are not asked: a call to an
        actor on a lost node can hang until Ray notices the loss.
        """
        gone = probe_dead_nodes({m.node_id for m in members}, self._raylets, wait_s=0.0)
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
        """Newest step whose snapshots, held by ``members``, cover the whole old layout."""
        coverage: dict[int, set[int]] = {}
        for info in self._query_snapshots(members):
            for owner, steps in (info or {}).items():
                for s in steps:
                    coverage.setdefault(s, set()).add(int(owner))
        needed = self.needed_owners()
        good = [s for s, owners in coverage.items() if needed(owners)]
        return max(good) if good else None

    def needed_owners(self):
        """A predicate: do these old ranks' snapshots hold the whole training state?

        Under DDP (zero 0) DP replicas hold identical state, so one owner per (pp, tp)
        coordinate suffices; under FSDP every old rank's shard is unique.
        """
        tp, pp, dp, zero = self.spec.parallel.tp, self.spec.parallel.pp, self.dp, self.spec.parallel.zero

        def coord(rank: int) -> tuple[int, int]:
            return ((rank // tp) % pp, rank % tp)

        if zero == 0:
            want = {(p, t) for p in range(pp) for t in range(tp)}
            return lambda owners: want <= {coord(r) for r in owners}
        return lambda owners: set(range(dp * tp * pp)) <= set(owners)

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
                m.poll_ref = m.actor.poll.remote()
        polls = [m.poll_ref for m in self.members if m.poll_ref is not None]
        runs = [m.run_ref for m in running]
        if runs:
            # Back as soon as any rank leaves run() (a failure is seen at once); polls
            # answered meanwhile are read now or at the next look.
            ray.wait(runs, num_returns=1, timeout=timeout)
        elif polls:
            ray.wait(polls, num_returns=len(polls), timeout=timeout)
        now = time.monotonic()
        for m in self.members:
            self._read_poll(m, obs, now)
            self._read_run(m)
        obs.failure = diagnose(self.members, self.spec.elastic, now, self._raylets)
        if obs.failure is None and self.members and all(m.run_result is not None for m in self.members):
            self._drain(obs)
            statuses = {m.run_result["status"] for m in self.members}
            obs.finished = statuses == {"done"}
            obs.stopped = "stopped" in statuses and statuses <= {"stopped", "done"}
        return obs

    def _drain(self, obs: Observation, members: list[Member] | None = None, timeout: float = RPC_TIMEOUT_S) -> None:
        """Collect the results ``members`` (default: all) produced since their last poll."""
        for m in members if members is not None else self.members:
            if m.dead:
                continue
            for _ in range(2):  # the poll in flight, then a fresh one
                if m.poll_ref is None:
                    m.poll_ref = m.actor.poll.remote()
                ray.wait([m.poll_ref], timeout=timeout)
                self._read_poll(m, obs, time.monotonic())
                if m.poll_ref is not None:  # no answer in time
                    break

    def drain_results(self, members: list[Member], timeout: float = 10.0) -> list[tuple[int, dict[str, Any]]]:
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
        m.last_ok, m.step = now, reply["step"]
        obs.results.extend((m.rank, r) for r in reply["results"])

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
                m.run_result = {"status": "dead"}

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
        size = self.replica_size
        by_replica: dict[int, list[Member]] = {}
        for m in members:
            by_replica.setdefault(m.rank // size, []).append(m)
        return [sorted(ms, key=lambda m: m.rank) for _, ms in sorted(by_replica.items()) if len(ms) == size]

    def release_group(self, group: Any) -> None:
        self.slots.release(group)

    def pid_of(self, rank: int) -> int:
        return next(m.pid for m in self.members if m.rank == rank)

    def pids_on_node(self, node_id: str) -> list[int]:
        return [m.pid for m in self.members if m.node_id == node_id]

    def shutdown(self) -> None:
        self.kill([m for m in self.members if not m.dead])
        self.slots.release_all()


def _host_indices(members: list[Member]) -> dict[str, int]:
    order: dict[str, int] = {}
    for m in members:
        order.setdefault(m.node_id, len(order))
    return order
