"""The worker group: the Ray-effectful half of the controller.

It owns the actors, their placement groups and the job's rendezvous store, launches
training, turns what it sees (polls, returned errors, dead actors, raylets that refuse
connections) into typed ``WorkerFailure``s, and carries out the controller's decisions:
evict ranks, re-form a ``ReformPlan`` as a new generation of the process group
(``group_configure.py``), add new replicas. It decides nothing: the plan comes whole from
``recovery_plan.py``, the diagnosis from ``diagnosis.py``. ``worker_group_api.py`` is the
interface the controller uses, which the tests' fake group implements too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from elastic.control import drain
from elastic.control.diagnosis import NODE_PROBE_S, RayletProbe, diagnose
from elastic.control.group_configure import RPC_TIMEOUT_S, build_requests, lost_failure_of, submit_and_gather
from elastic.control.recovery_plan import Holdings, ReformPlan
from elastic.control.worker_group_api import ConfigureResult, Observation
from elastic.errors import ActorDied
from elastic.ingest.host_readers import HostReaders
from elastic.messages import DEAD, RunOutcome, WorkerInfo, WorkerReport
from elastic.placement.planned import PlannedSlots, placement_fields
from elastic.placement.slots import ReplicaSlots, group_tables
from elastic.worker import TrainWorker
from elastic.worker.hooks import StepHook
from elastic.worker.process_group import RendezvousStore

if TYPE_CHECKING:
    from elastic.spec import JobSpec

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1  # how often the controller looks at (and polls) the group
SNAPSHOT_QUERY_S = 10.0  # how long the snapshot holdings query waits for answers, in all


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


class WorkerGroup:
    planned_placement = True  # docs/placement.md; False: the old one PACK group per replica, in Ray's order

    def __init__(self, spec: JobSpec, corpus_uri: str, step_hook: StepHook | None = None, storage_uri: str = ""):
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
        self._avoid_nodes: set[str] = set()  # node ids Ray is draining (elastic/control/drain.py)
        self._lost_failure = lost_failure_of(self.raylets, NODE_PROBE_S)

    # ------------------------------------------------------------------ capacity
    def request_capacity(self) -> None:
        self.slots.request(self.spec.elastic.max_dp)

    def exclude_nodes(self, nodes: list[str]) -> None:
        """Lemon nodes (docs/health.md): no replica is placed on them again in this job."""
        # Workers already there stay until they fail or are evicted: only new placements avoid them.
        self.slots.exclude(set(nodes), keep={id(m.group) for m in self.members if not m.dead})
        self.request_capacity()

    def draining_nodes(self) -> dict[str, drain.DrainNotice]:
        """Live nodes Ray is draining, with their deadlines (a ~1 ms read of the GCS)."""
        return drain.draining_nodes()

    def avoid(self, nodes: set[str]) -> None:
        """Node ids Ray is draining: no replica is planned or grown there until they stop draining."""
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
        if self._avoid_nodes:  # draining nodes are not grown into (elastic/control/drain.py)
            table = group_tables(spare)
            spare = [g for g in spare if not group_nodes(table[g.id.hex()]) & self._avoid_nodes]
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
    def configure(self, plan: ReformPlan[Member]) -> ConfigureResult:
        """Carry ``plan`` out: its members become ranks 0..n-1 of a new generation of the
        group and restore the state it names."""
        members = plan.members
        for rank, m in enumerate(members):
            m.rank, m.run_ref, m.run_result, m.poll_ref = rank, None, None, None
        # From here on these are the members: a loss below is a failure of this layout,
        # and the next recovery evicts it by its new rank (newcomers are not leaked).
        self.members = list(members)
        if self._store is None:
            self._store = RendezvousStore(ray.util.get_node_ip_address(), self.spec.elastic.collective_timeout_s)
        self._generation += 1
        p = self.spec.parallel
        requests = build_requests(
            plan,
            generation=self._generation,
            dims=(plan.dp, p.tp, p.pp),
            store=self._store.address,
            storage_uri=self.storage_uri,
            storage_options=self.spec.checkpoint.storage_options,
            read_plans=self.readers.plans([m.node_id for m in members], self._generation),  # docs/data.md
        )
        result = submit_and_gather(
            members, requests, self._generation, self.spec.elastic.collective_timeout_s, self._lost_failure
        )
        self.dp = plan.dp
        now = time.monotonic()
        for m in members:
            m.last_ok, m.step = now, result.step
        return result

    def rack_of(self, node_id: str) -> str:
        return self._node_labels.get(node_id, {}).get("rack", "")

    def snapshot_holdings(self, members: Sequence[Member]) -> list[Holdings | None]:
        """Each member's memory-tier holdings; None for one that is gone or silent.

        Members on a node whose raylet refuses connections are not asked: a call to an
        actor on a lost node can hang until Ray notices the loss.
        """
        gone = self.raylets.dead({m.node_id for m in members}, wait_s=0.0)
        refs = [None if m.node_id in gone else m.actor.snapshot_holdings.remote() for m in members]
        asked = [r for r in refs if r is not None]
        if asked:
            ray.wait(asked, num_returns=len(asked), timeout=SNAPSHOT_QUERY_S)
        out: list[Holdings | None] = []
        for ref in refs:
            try:
                out.append(None if ref is None else ray.get(ref, timeout=0))
            except (RayActorError, ActorUnavailableError, GetTimeoutError):
                out.append(None)
        return out

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

    def save_checkpoints(self, timeout: float) -> None:
        """After a stop at a step boundary: every rank writes the live step to storage."""
        refs = [m.actor.save_checkpoint.remote(timeout) for m in self.members if not m.dead]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)

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

    def release_group(self, group: Any) -> None:
        self.slots.release(group)

    def placement(self) -> dict[str, object]:
        """The ``placement`` event's fields for the current members (docs/outputs.md)."""
        p = self.spec.parallel
        return placement_fields(self.dp, p.tp, p.pp, self.members, self._node_labels)

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


def group_nodes(table: dict[str, Any]) -> set[str]:
    """The node ids a placement group's bundles are on, from its GCS record (``group_tables``)."""
    return set((table.get("bundles_to_node_id") or {}).values())
