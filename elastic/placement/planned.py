"""Placement that follows the topology at run time (``docs/placement.md``).

At start, after a failure and while capacity returns, the worker group asks for replicas.
``PlannedSlots`` answers from the live cluster: it reads the nodes (their resources and
the labels ``rack`` and ``nvlink_domain``), takes out what the job already holds, plans
the free capacity with the topology planner (``elastic/placement/planner.py``: TP groups inside a
node or NVLink domain, a replica's stages inside one rack when it fits), and asks Ray for
one placement group per planned replica that *enforces* the plan:

* every bundle carries the label selector ``{"ray.io/node-id": <planned node>}``, so
  bundle ``b`` (= rank ``b`` of the replica, TP fastest then PP) lands on exactly the node
  the plan gave it, or not at all;
* a replica planned inside one rack also gets ``topology_strategy={"rack": "STRICT_PACK"}``
  (Ray's own rule that the whole group shares one value of the ``rack`` label). It is
  redundant with the node selectors, and says the intent to Ray.

Replicas are then numbered rack by rack (``WorkerGroup.rank_order``), so the DP ring
crosses racks as few times as the plan computes. A node that is lost is excluded for good
(a node that returns is a new raylet with a new node id); its replicas' capacity is
re-planned on the survivors and on nodes that join. Pure helpers (plan -> bundles and
selectors, the ``placement`` event) are separate from the one class that talks to Ray.

When the spec gives no resource to plan by (``cpus_per_worker: 0`` on cpu), the old
placement (one PACK group per replica, in Ray's order) is the fallback.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from elastic.errors import InfeasibleError, SpecError
from elastic.parallel.dims import rank_coords
from elastic.placement.planner import LayoutPlan, plan_groups, spec_placement_args
from elastic.placement.slots import ReplicaSlots
from elastic.placement.topology import RACK, ClusterTopology, topology_from_ray

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it
REPLAN_S = 1.0  # at most one look at the cluster per second while capacity is missing
# A group pinned to live nodes with room is placed in milliseconds. The grow path looks this
# long for it, so a returning node is used at this grow check, not the next. Starting and
# recovering do not wait: a group pinned to a node that is dying could be placed just before
# the node goes, and the actor started on it would hang until Ray notices the loss.
GROW_READY_WAIT_S = 0.2


# ---------------------------------------------------------------------- pure helpers


def plan_free_capacity(
    spec: Any, topology: ClusterTopology, used: Mapping[str, int], excluded: Iterable[str], count: int
) -> LayoutPlan | None:
    """Up to ``count`` new replicas planned on what is free: each node's worker slots minus
    ``used`` (workers the job holds there, by node id), without the ``excluded`` node ids.
    None when not one whole replica fits."""
    if count <= 0:
        return None
    args = spec_placement_args(spec)
    size = (args["device"], args["slots_per_worker"], args["cpus_per_worker"], args["custom"])
    drop = set(excluded)
    free = ClusterTopology(
        replace(n, slots=max(0, n.worker_slots(*size) - used.get(n.node_id or n.name, 0)))
        for n in topology
        if (n.node_id or n.name) not in drop
    )
    try:
        p = spec.parallel  # EP and CP groups inside a node when they fit (``plan_groups``)
        return plan_groups(free, p.tp, p.pp, getattr(p, "ep", 1), getattr(p, "cp", 1), min_dp=1, max_dp=count, **args)
    except InfeasibleError:
        return None


def replica_nodes(plan: LayoutPlan, topology: ClusterTopology) -> list[tuple[str, ...]]:
    """For each planned replica (dp order), the node id of each of its ranks in rank order."""
    ids = {n.name: n.node_id or n.name for n in topology}
    size = plan.tp * plan.pp
    nodes = [ids[r.node] for r in plan.ranks]
    return [tuple(nodes[i : i + size]) for i in range(0, len(nodes), size)]


def placement_group_args(
    node_ids: Sequence[str], node_labels: Mapping[str, Mapping[str, str]], bundle: Mapping[str, float]
) -> dict[str, Any]:
    """``ray.util.placement_group`` keywords that pin bundle ``b`` to ``node_ids[b]``.

    A replica whose nodes all carry the same ``rack`` label also asks Ray to keep the
    group inside that rack (``topology_strategy``); otherwise the node-level strategy is
    PACK. The rack rule is only used with a real Ray label (not a ``rack:r0`` resource).
    """
    racks = {node_labels.get(n, {}).get(RACK) for n in node_ids}
    args: dict[str, Any] = {
        "bundles": [dict(bundle) for _ in node_ids],
        "bundle_label_selector": [{NODE_ID_LABEL: n} for n in node_ids],
    }
    if len(racks) == 1 and None not in racks:
        args["topology_strategy"] = {RACK: "STRICT_PACK"}
    else:
        args["strategy"] = "PACK"
    return args


def ring_rack_crossings(racks_by_rank: Sequence[str | None], dp: int, tp: int, pp: int) -> int:
    """Most rack-to-rack hops of any DP ring (one ring per (pp_rank, tp_rank))."""
    if dp < 2:
        return 0
    size = tp * pp
    worst = 0
    for offset in range(size):
        racks = [racks_by_rank[d * size + offset] for d in range(dp)]
        worst = max(worst, sum(racks[i] != racks[(i + 1) % dp] for i in range(dp)))
    return worst


def placement_fields(
    dp: int,
    tp: int,
    pp: int,
    members: Sequence[Any],
    node_labels: Mapping[str, Mapping[str, str]],
    ep: int = 1,
    cp: int = 1,
) -> dict[str, Any]:
    """The ``placement`` event (``docs/outputs.md``) for members with ``rank``, ``node_id``,
    ``ip`` and ``pid``; ``ep_rank`` and ``cp_rank`` too when ``ep`` or ``cp`` is above 1."""
    ranks = []
    for m in sorted(members, key=lambda m: m.rank):
        c = rank_coords(m.rank, tp, pp, ep, cp)
        extra = ({"ep_rank": c.ep_rank} if ep > 1 else {}) | ({"cp_rank": c.cp_rank} if cp > 1 else {})
        ranks.append(
            {
                "rank": m.rank,
                "dp_rank": c.dp_rank,
                "pp_rank": c.pp_rank,
                "tp_rank": c.tp_rank,
                **extra,
                "node_id": m.node_id,
                "node_ip": m.ip,
                "pid": m.pid,
                "labels": dict(node_labels.get(m.node_id, {})),
            }
        )
    racks = [r["labels"].get(RACK) for r in ranks]
    inner = tp * ep * cp  # a DP ring per rank of a replica: the replica is pp x (ep x cp x tp)
    crossings = ring_rack_crossings(racks, dp, inner, pp) if len(racks) == dp * inner * pp else 0
    degrees = {"dp": dp, "tp": tp, "pp": pp} | ({"ep": ep} if ep > 1 else {}) | ({"cp": cp} if cp > 1 else {})
    return {**degrees, "ring_rack_crossings": crossings, "ranks": ranks}


# ---------------------------------------------------------------------- on Ray


class PlannedSlots(ReplicaSlots):
    """``ReplicaSlots`` whose groups are planned from the live topology and pinned to nodes.

    ``request(total)`` sets how many replicas the job wants and plans the missing ones on
    the free capacity; ``ready()`` plans again (at most every ``REPLAN_S``) while fewer are
    held, which is how a node that joins becomes a new replica where the plan puts it.
    ``raylets`` is the group's ``RayletProbe``: a planned node whose raylet refuses
    connections is excluded before a group is pinned to it.
    """

    def __init__(self, spec: Any, raylets: Any):
        p = spec.parallel
        super().__init__(spec.resources, p.replica_size, p.tp, p.pp)
        self.spec, self.raylets = spec, raylets
        self.planned: dict[str, tuple[str, ...]] = {}  # group id -> node id of each bundle
        self.excluded: set[str] = set()  # node ids found dead: never planned again
        self.lemons: set[str] = set()  # node ids excluded by the health monitor (their live groups stay)
        self.draining: set[str] = set()  # node ids Ray is draining: not planned while they drain
        self.node_labels: dict[str, dict[str, str]] = {}
        self.fallback: str | None = None  # why the old placement is used, if it is
        self._vetted: set[str] = set()  # groups whose nodes were probed once placed
        self._target = 0
        self._last_plan = float("-inf")

    def request(self, total: int) -> None:
        self._target = total
        if self.fallback is None:
            self._replan(wait_s=0.0)
        if self.fallback is not None:
            super().request(total)

    def ready(self, timeout: float = 0.0) -> list[Any]:
        if (
            self.fallback is None
            and len(self._groups) < self._target
            and time.monotonic() - self._last_plan >= REPLAN_S
        ):
            self._replan(wait_s=GROW_READY_WAIT_S)
        return self._vet(super().ready(timeout))

    def _vet(self, created: list[Any]) -> list[Any]:
        """Drop a newly placed group whose node's raylet is gone: Ray may place a group on a
        node in the moments before it dies, and an actor started there hangs until Ray
        notices. Each group is probed once, when it is first seen placed."""
        new = [g for g in created if g.id.hex() in self.planned and g.id.hex() not in self._vetted]
        if not new:
            return created
        dead = self.raylets.dead({n for g in new for n in self.planned[g.id.hex()]}, wait_s=0.0, refused_only=True)
        self._vetted.update(g.id.hex() for g in new)
        if not dead:
            return created
        self.excluded |= dead
        gone = [g for g in new if dead & set(self.planned[g.id.hex()])]
        for g in gone:
            self.release(g)
        return [g for g in created if g not in gone]

    def release(self, group: Any) -> None:
        self.planned.pop(group.id.hex(), None)
        super().release(group)

    def exclude(self, node_ids: Iterable[str], keep: frozenset[int] | set[int] = frozenset()) -> None:
        """Lemon nodes (docs/health.md): never planned again. Groups pinned there are
        released, except those in ``keep`` (ids of groups with live workers, which stay
        until they fail or are evicted)."""
        nodes = set(node_ids)
        self.lemons |= nodes
        self._release_pinned(self.lemons, keep)
        if self.fallback is not None:
            super().exclude(nodes, set(keep))

    def avoid(self, node_ids: Iterable[str], keep: frozenset[int] | set[int] = frozenset()) -> None:
        """Nodes Ray is draining (``elastic/control/drain.py``): not planned while they drain, and groups
        pinned there that host no live worker (``keep``: the ids of those that do) are released,
        since Ray places nothing on a draining node and such a group would wait forever. A node
        that stops draining is planned again at the next re-plan."""
        self.draining = set(node_ids)
        if self._release_pinned(self.draining, keep) or not self.draining:
            self._last_plan = float("-inf")  # re-plan at the next ready()

    def _release_pinned(self, nodes: set[str], keep: frozenset[int] | set[int]) -> bool:
        """Release the groups pinned to any of ``nodes``, except those in ``keep`` (ids of
        groups with live workers); True if any was released."""
        gone = [g for g in self._groups if id(g) not in keep and set(self.planned.get(g.id.hex(), ())) & nodes]
        for g in gone:
            self.release(g)
        return bool(gone)

    def _replan(self, wait_s: float) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self._last_plan = time.monotonic()
        alive = [n for n in ray.nodes() if n.get("Alive")]
        self.raylets.update({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"]) for n in alive})
        self.node_labels.update({n["NodeID"]: dict(n.get("Labels") or {}) for n in alive})
        topology = topology_from_ray(alive)
        self._forget_groups_on({n["NodeID"] for n in alive})
        for _ in range(3):  # a planned node found dead is excluded and the plan redone
            want = self._target - len(self._groups)
            used = Counter(nid for g in self._groups for nid in self.planned.get(g.id.hex(), ()))
            try:
                plan = plan_free_capacity(self.spec, topology, used, self.excluded | self.lemons | self.draining, want)
            except SpecError as exc:
                self.fallback = str(exc)
                logger.warning("placement by plan is off (%s): one PACK group per replica instead", self.fallback)
                return
            if plan is None:
                return
            replicas = replica_nodes(plan, topology)
            dead = self.raylets.dead({n for r in replicas for n in r}, wait_s=0.0, refused_only=True)
            if dead:
                self.excluded |= dead
                continue
            new = []
            for nodes in replicas:
                g = placement_group(**placement_group_args(nodes, self.node_labels, self.bundle()))
                self._groups.append(g)
                self.planned[g.id.hex()] = nodes
                new.append(g)
            logger.info("placement: %d replica(s) planned on %s", len(new), [sorted(set(r)) for r in replicas])
            if wait_s > 0:
                ray.wait([g.ready() for g in new], num_returns=len(new), timeout=wait_s)
            return

    def bundle_nodes(self, groups: Sequence[Any]) -> list[str]:
        """A pinned group's nodes are its plan's (no GCS read); the others' are read."""
        unplanned = [g for g in groups if g.id.hex() not in self.planned]
        return [n for g in groups for n in self.planned.get(g.id.hex(), ())] + super().bundle_nodes(unplanned)

    def _forget_groups_on(self, alive: set[str]) -> None:
        """Release groups pinned to a node that left (or was excluded): they can never be placed."""
        for g in list(self._groups):
            nodes = set(self.planned.get(g.id.hex(), ()))
            if nodes - alive or nodes & self.excluded:
                self.release(g)
