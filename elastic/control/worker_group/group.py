"""The worker group: the Ray-effectful half of the controller.

It owns the actors, their placement groups and the job's rendezvous store, launches
training, turns what it sees (returned errors, dead actors, silent ranks, raylets that
refuse connections) into typed ``WorkerFailure``s, and carries out the controller's
decisions: evict ranks, re-form a ``ReformPlan`` as a new generation of the process group
(``configure.py``), add new replicas. It decides nothing: the plan comes whole from
``recovery_plan.py``, the diagnosis from ``diagnosis.py``. ``api.py`` is the
interface the controller uses, which the tests' fake group implements too.

It does not talk to ranks: node agents do (``elastic/agent/``), and the group reaches them
through the agent tree (``agent_link.py``): one command per channel, one digest per channel
per look, whatever the number of ranks (``poll.py`` applies what comes back).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from elastic.agent.actors import AggregatorActor, NodeAgentActor
from elastic.control import drain
from elastic.control.agent_link import FAN_IN, AgentTree
from elastic.control.diagnosis import NODE_PROBE_S, RayletProbe, diagnose
from elastic.control.recovery_plan import Holdings, ReformPlan
from elastic.control.spawning import PendingSpawn
from elastic.control.worker_group.api import ConfigureResult, Observation
from elastic.control.worker_group.configure import RPC_TIMEOUT_S, build_requests, lost_failure_of, reconfigure_ranks
from elastic.control.worker_group.poll import Gather, GroupPoll
from elastic.control.worker_group.state import GroupState, by_node, wids_by_node
from elastic.control.worker_group.worker import Member
from elastic.errors import ActorDied, WorkerFailure
from elastic.ingest.host_readers import HostReaders
from elastic.messages import (
    AbortStep,
    Attach,
    Detach,
    Flush,
    Launch,
    NodeCommand,
    Query,
    RequestStop,
    SaveCheckpoint,
    Signal,
    SnapshotHoldings,
    links_to,
)
from elastic.placement.planned import PlannedSlots, placement_fields
from elastic.placement.slots import ReplicaSlots, group_tables
from elastic.worker import TrainWorker, start_args
from elastic.worker.hooks import StepHook
from elastic.worker.process_group import RendezvousStore

if TYPE_CHECKING:
    from elastic.spec import JobSpec

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1  # how long one look at the group waits for news
SNAPSHOT_QUERY_S = 10.0  # how long the snapshot holdings query waits for answers, in all


class WorkerGroup:
    agent_fan_in = FAN_IN  # children per aggregator of the agent tree (agent_link.py)

    def __init__(self, spec: JobSpec, corpus_uri: str, step_hook: StepHook | None = None, storage_uri: str = ""):
        self.spec = spec
        self.corpus_uri = corpus_uri
        self.readers = HostReaders(spec, corpus_uri)  # one data reader per reading host (docs/data.md)
        self.storage_uri = storage_uri  # where the storage tier writes ("" for none)
        self.step_hook = step_hook
        self.replica_size = spec.parallel.replica_size
        self.raylets = RayletProbe()  # node id -> raylet address, for liveness probes
        self.slots = self._make_slots()
        self.state = GroupState()  # the members, ordered by rank, and their indexes
        self.dp = 0
        self.tree = AgentTree(self._make_agent, self._make_aggregator, self.agent_fan_in)
        self._store: RendezvousStore | None = None  # the job's rendezvous, made at the first configure
        self._generation = 0  # of the process group: the rendezvous key prefix
        self._node_labels: dict[str, dict[str, str]] = {}  # node id -> Ray node labels (rack, nvlink_domain)
        self._avoid_nodes: set[str] = set()  # node ids Ray is draining (elastic/control/drain.py)
        self._starting: list[PendingSpawn] = []  # starts begun and not yet collected (spawn_begin)
        self._lost_failure = lost_failure_of(self.raylets, NODE_PROBE_S)
        self.poll = GroupPoll(self.tree, self.raylets, self.state, spec.elastic.heartbeat_timeout_s)
        self._holdings_ahead: tuple[frozenset[int], Gather] | None = None  # asked with an abort (abort_steps)
        self.configure_sent_at: list[float] = []  # driver clock: each configure's requests all sent

    @property
    def members(self) -> list[Member]:
        """Ordered by rank."""
        return self.state.members

    @members.setter
    def members(self, members: list[Member]) -> None:
        self.state.members = members

    # ------------------------------------------------------------------ seams (the control-plane benchmark's)
    def _make_slots(self) -> ReplicaSlots:
        return PlannedSlots(self.spec, self.raylets)  # docs/placement.md

    def _make_agent(self, node: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAgentActor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(node)

    def _make_aggregator(self) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()  # with the driver: it dies only with the job
        return AggregatorActor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote()

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

    def spawn(self, groups: Sequence[Any]) -> list[Member]:
        """Start one actor per bundle of each placement group (a whole replica each) and wait
        until all have started, or the start stalled: the new members."""
        pending = self.spawn_begin(groups)
        while (members := self.spawn_end(pending, wait_s=1.0)) is None:
            pass  # starting, and not stalled (``PendingSpawn.infos`` raises once it is)
        return members

    def spawn_begin(self, groups: Sequence[Any]) -> PendingSpawn:
        """Create the actors and hand each node's to its agent (started with them,
        ``_start_agents``); returns at once (``spawn_end`` collects them)."""
        self._start_agents(groups)
        actors = []
        # The step hook goes to the first workers only: an injected fault fires once per
        # job, not again in a replacement that replays the step.
        hook, self.step_hook = self.step_hook, None
        args = start_args(self.spec, self.corpus_uri, hook)  # pickled once, not once per rank
        for g in groups:
            for b in range(self.replica_size):
                opts = self.slots.actor_options(g, b)
                actors.append((g, b, TrainWorker.options(**opts).remote(args)))
        pending = PendingSpawn(actors, [a.info.remote() for _, _, a in actors], stall_s=RPC_TIMEOUT_S)
        self._starting.append(pending)
        return pending

    def spawn_end(self, pending: PendingSpawn, wait_s: float) -> list[Member] | None:
        """The new members once every actor of ``pending`` has started; None while some are
        starting. Raises ``ActorDied`` if one was lost or the start passed its deadline."""
        try:
            infos = pending.infos(wait_s)
        except ActorDied:
            self._starting.remove(pending)
            raise
        if infos is None:
            return None
        self._starting.remove(pending)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.raylets.update({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"]) for n in nodes})
        self._node_labels.update({n["NodeID"]: dict(n.get("Labels") or {}) for n in nodes})
        members = [Member(a, g, b, i.node_id, i.ip, i.pid) for (g, b, a), i in zip(pending.actors, infos)]
        self._adopt(members)
        return members

    def spawn_cancel(self, pending: PendingSpawn) -> None:
        """Kill a start's actors before they became members."""
        pending.cancel()
        if pending in self._starting:
            self._starting.remove(pending)

    def _adopt(self, members: list[Member]) -> None:
        """Give new members worker ids and their nodes' agents (new nodes get one)."""
        self.state.number(members)
        self._attach(members)

    def _start_agents(self, groups: Sequence[Any]) -> None:
        """Start the agents of the nodes ``groups`` are placed on now, before their workers:
        an agent's process start then overlaps the workers' imports, instead of following
        them into the first configure."""
        counts = Counter(self.slots.bundle_nodes(groups))
        if counts:
            self.tree.add_nodes(list(counts), self._expected_nodes(max(counts.values())))

    def _expected_nodes(self, per_node: int) -> int:
        """The most nodes the job may span, ``per_node`` ranks on each (the tree's depth)."""
        return -(-self.spec.elastic.max_dp * self.replica_size // per_node)

    def _attach(self, members: list[Member]) -> None:
        grouped = by_node(members)
        per_node = max(len(ms) for ms in grouped.values()) if grouped else 1
        self.tree.add_nodes(list(grouped), self._expected_nodes(per_node))  # nodes without an agent yet
        self.tree.send({node: Attach({m.wid: (m.actor, m.rank) for m in ms}) for node, ms in grouped.items()})

    # ------------------------------------------------------------------ (re)configuration
    def reform(self, plan: ReformPlan[Member]) -> ConfigureResult:
        """Carry ``plan`` out: its members become ranks 0..n-1 of a new generation of the
        group and restore the state it names."""
        members = plan.members
        # From here on these are the members: a loss below is a failure of this layout,
        # and the next recovery evicts it by its new rank (newcomers are not leaked).
        self.state.form(members)
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
            store_secret=self._store.secret,
        )
        self._store.take_denials()  # refusals before this generation are not its
        try:
            with self.poll.configuring():
                result = reconfigure_ranks(
                    self.poll,
                    members,
                    requests,
                    self._generation,
                    self.spec.elastic.collective_timeout_s,
                    self._lost_failure,
                    self.configure_sent_at,
                )
        except WorkerFailure as failure:  # outsiders refused meanwhile: the failure says so
            failure.note_store_denials(self._store.take_denials())
            raise
        self.dp = plan.dp
        now = time.monotonic()
        for m in members:
            m.last_ok, m.step = now, result.step
        return result

    def rack_of(self, node_id: str) -> str:
        return self._node_labels.get(node_id, {}).get("rack", "")

    # ------------------------------------------------------------------ running
    def launch(self, last_step: int) -> None:
        nodes = wids_by_node([m for m in self.members if not m.dead])
        cid = self.tree.send(dict.fromkeys(nodes, Launch(last_step)))
        for m in self.members:
            m.run_result, m.since, m.launched, m.quiet = None, cid, True, False

    def observe(self, timeout: float = POLL_INTERVAL_S) -> Observation:
        now = self.poll.look(timeout)
        obs = Observation(results=self.poll.take())
        if self.poll.evidence():
            self.poll.refresh_last_ok(now)
            obs.failure = diagnose(self.members, self.spec.elastic, now, self.raylets)
        if obs.failure is None and self.members and self._all_returned():
            obs.results.extend(self.drain_results(self.members, RPC_TIMEOUT_S))
            statuses = {m.run_result.status for m in self.members if m.run_result}  # all (_all_returned)
            obs.finished = statuses == {"done"}
            obs.stopped = "stopped" in statuses and statuses <= {"stopped", "done"}
        return obs

    def _all_returned(self) -> bool:
        returned = sum(1 for m in self.state.notable_members() if m.run_result is not None)
        if returned < len(self.members):  # O(news): most looks stop here
            return False
        return all(m.run_result is not None for m in self.members)

    def request_stop(self) -> None:
        self.tree.send(dict.fromkeys(wids_by_node([m for m in self.members if not m.dead]), Signal(RequestStop())))

    def wait_runs(self, members: Sequence[Member], timeout: float) -> list[Member]:
        """Wait for ``members``' run() calls to return; returns those that did not."""
        deadline = time.monotonic() + timeout
        while True:
            running = [m for m in members if m.launched and m.run_result is None and not m.dead]
            left = deadline - time.monotonic()
            if not running or left <= 0:
                return running
            self.poll.look(min(left, POLL_INTERVAL_S))

    # ------------------------------------------------------------------ questions, and commands that interrupt a step
    def snapshot_holdings(self, members: Sequence[Member]) -> list[Holdings | None]:
        """Each member's memory-tier holdings; None for one that is gone or silent.

        Members on a node whose raylet refuses connections are not asked: a call to an
        actor on a lost node can hang until Ray notices the loss. Only nodes out of reach
        (their agent, or a link above it, unanswered or dead) are probed: every other node
        answered the tree just now (at 16k ranks, probing every raylet was a quarter of a
        second of the recovery's decision).
        """
        gone = self.raylets.dead(self.poll.out_of_reach({m.node_id for m in members}), wait_s=0.0)
        asked = [m for m in members if m.node_id not in gone and not m.dead]
        ahead, self._holdings_ahead = self._holdings_ahead, None
        wanted = {m.wid for m in asked}
        if ahead is not None and wanted <= ahead[0]:
            g = ahead[1]  # asked with the abort of the step: answered as each run ended
            g.lose(set(ahead[0]) - wanted)  # killed or left out since: not waited for
        else:
            if ahead is not None:
                self.poll.done(ahead[1])
            expect = wids_by_node(asked)
            holdings = SnapshotHoldings()
            g = self.poll.command({n: Query(holdings, tuple(ws)) for n, ws in expect.items()}, expect)
        self.poll.wait_for(g, SNAPSHOT_QUERY_S)
        self.poll.done(g)
        return [g.replies.get(m.wid) for m in members]

    def drain_results(self, members: Sequence[Member], timeout: float = 10.0) -> list[tuple[int, Any]]:
        """The results ``members`` reported that the controller has not seen yet: every
        agent sends up all its ranks reported before it answers. A member whose run ended
        with nothing asked of it since is not asked: all it reported came with its end."""
        expect = wids_by_node([m for m in members if not m.dead and not m.quiet])
        g = self.poll.command({n: Flush(tuple(ws)) for n, ws in expect.items()}, expect)
        self.poll.wait_for(g, timeout)
        self.poll.done(g)
        for node, state in g.states.items():
            for m in self.state.on_node(node) if state.step > 0 else ():
                m.step = max(m.step, state.step)
        return self.poll.take()

    def save_checkpoints(self, timeout: float) -> None:
        """After a stop at a step boundary: every rank writes the live step to storage."""
        live = [m for m in self.members if not m.dead]
        for m in live:
            m.quiet = False  # its checkpoint's upload reports come after its run's end
        expect = wids_by_node(live)
        save = SaveCheckpoint(timeout)
        g = self.poll.command({n: Query(save, tuple(ws)) for n, ws in expect.items()}, expect)
        self.poll.wait_for(g, timeout)
        self.poll.done(g)

    def abort_steps(self, members: Sequence[Member], lost: Sequence[Member] = ()) -> None:
        """A peer was lost: every member leaves the step in flight at its next block (fire
        and forget, through the members' node agents: one message per aggregator link, not
        one actor call per rank from the driver), and shuts down its links to the ``lost``
        ranks (their connections, seen from the other end: ``links_to``).

        The recovery's next question goes down with it: each member's snapshot holdings as
        of the end of its run (``TrainWorker.snapshot_holdings(after_run_s)``), so they come
        up with the runs' ends and ``snapshot_holdings`` finds them in, instead of asking
        after every run has ended (a round trip of the tree: at 16k ranks, tenths of a
        second of the recovery's decision)."""
        self.readers.pause()  # the old layout's reads stop here, not at the next layout's plans
        by_node = wids_by_node(members)
        links = links_to(c for m in lost for c in m.connections)
        self.tree.send(dict.fromkeys(by_node, Signal(AbortStep(self._generation, links))))
        if self._holdings_ahead is not None:
            self.poll.done(self._holdings_ahead[1])
        holdings = SnapshotHoldings(after_run_s=SNAPSHOT_QUERY_S)
        query: dict[str, NodeCommand] = {n: Query(holdings, tuple(ws)) for n, ws in by_node.items()}
        self._holdings_ahead = (frozenset(m.wid for m in members), self.poll.command(query, by_node))

    def kill(self, members: Sequence[Member]) -> None:
        for m in members:
            m.dead = True
            try:
                ray.kill(m.actor, no_restart=True)
            except Exception as exc:  # already dead
                logger.debug("kill of rank %s failed: %s", m.rank, exc)
        pids = {m.wid: m.pid or 0 for m in members}
        detach = {
            node: Detach(tuple(ws), tuple(pids[w] for w in ws if pids[w] > 0))
            for node, ws in wids_by_node(members).items()
            if node in self.tree.handles
        }
        if detach:
            self.tree.send(detach)

    def shrink(self, members: Sequence[Member], excluded: Sequence[int]) -> None:
        """NCCL: every member shrinks the group without the ``excluded`` ranks, at once
        (its control thread; the collectives its train thread is blocked in are aborted).
        Fire and forget: each member's ``run()`` then returns, as after any peer error."""
        self.readers.pause()  # as in abort_steps
        for m in members:
            m.actor.shrink_group.remote(tuple(excluded))

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

    def agent_pid(self, node_id: str) -> int:
        """The pid of ``node_id``'s agent (for the tests' faults)."""
        return ray.get(self.tree.handles[node_id].where.remote(), timeout=RPC_TIMEOUT_S)[1]

    def shutdown(self) -> None:
        for pending in list(self._starting):  # a grow-back's workers still starting
            self.spawn_cancel(pending)
        self.kill([m for m in self.members if not m.dead])
        self.tree.shutdown()
        self.readers.close()
        self.slots.release_all()
        if self._store is not None:
            self._store.close()
            self._store = None


def group_nodes(table: dict[str, Any]) -> set[str]:
    """The node ids a placement group's bundles are on, from its GCS record (``group_tables``)."""
    return set((table.get("bundles_to_node_id") or {}).values())
