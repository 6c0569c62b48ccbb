"""Rank layout: which worker runs where, decided from the topology alone (pure, no Ray).

The layout follows the interconnect, innermost first:

1. **TP groups** (``tp`` workers that all-reduce every layer) live inside one NVLink
   domain: one node, or several nodes that share an ``nvlink_domain`` label (GB200
   NVL72). On GPUs this is strict. On CPUs (gloo, local tests) ``allow_cross_node_tp``
   lets a group span nodes when no node is big enough; even then node-local groups are
   formed first, then rack-local ones.
2. **Replicas** (``pp`` TP groups, one per pipeline stage) are packed node-first, then
   rack-first. Only the leftovers of every rack are pooled into replicas that span racks;
   those are flagged (``LayoutPlan.cross_rack_dp_ranks``). This greedy packing gives the
   largest possible number of replicas *and* the fewest cross-rack ones, because at each
   level it only pools what the level below could not use.
3. **DP** is the largest allowed number of whole replicas (``min_dp <= dp <= max_dp``,
   ``dp in allowed_dps``). When fewer replicas are used than fit, whole racks are filled
   first (racks holding more replicas first), then cross-rack replicas.
4. **DP ring order**: replicas are numbered rack by rack, so every DP ring (one per
   ``(pp_rank, tp_rank)``) enters and leaves each rack once: it crosses racks as few times
   as possible (``LayoutPlan.ring_rack_crossings``).

Rank order (the contract with the runtime, which builds the ``DeviceMesh`` from it)::

    rank = ((dp_rank * pp) + pp_rank) * tp + tp_rank      # mesh dims ("dp", "pp", "tp")

tp is fastest, dp slowest. torchtitan and Megatron put pp outermost (``("pp", "dp",
"tp")``) because there the launcher maps consecutive ranks onto consecutive hosts, so
the rank order *is* the placement. Here the planner places every rank explicitly, so
the order buys no locality either way, and dp outermost has the property elasticity
needs: a model replica is one contiguous block of ``tp * pp`` ranks. Dropping or adding
a replica never renumbers the ranks inside the others; it only shifts whole blocks.

Longer than the ~350 lines we aim for: one placement algorithm and its JSON document, which
read best together.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

from elastic.errors import InfeasibleError, SpecError
from elastic.parallel.dims import rank_coords, rank_of
from elastic.placement.topology import NVLINK_DOMAIN, ClusterTopology, NodeInfo

MESH_DIM_NAMES: tuple[str, str, str] = ("dp", "pp", "tp")

T = TypeVar("T")
# A TP group is the tuple of node names of its tp ranks; a replica is pp TP groups.
TPGroup = tuple[str, ...]


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: str
    dp_rank: int
    pp_rank: int
    tp_rank: int

    def to_dict(self) -> dict[str, Any]:
        # Key order is part of the `elastic plan --json` contract.
        return {
            "rank": self.rank,
            "node": self.node,
            "dp_rank": self.dp_rank,
            "pp_rank": self.pp_rank,
            "tp_rank": self.tp_rank,
        }


@dataclass(frozen=True)
class LayoutPlan:
    dp: int
    tp: int
    pp: int
    ranks: tuple[RankPlacement, ...]
    device: str = "cuda"
    node_racks: dict[str, str | None] = field(default_factory=dict)
    max_replicas: int = 0  # whole replicas the topology could hold
    min_dp: int = 1
    max_dp: int | None = None
    allowed_dps: tuple[int, ...] | None = None
    notes: tuple[str, ...] = ()
    # After drop_nodes: for each new dp_rank, the dp_rank it had in the plan it came from.
    origin_dp_ranks: tuple[int, ...] | None = None

    mesh_dim_names: ClassVar[tuple[str, str, str]] = MESH_DIM_NAMES

    # ------------------------------------------------------------------ rank algebra
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        for name, value, size in (("dp", dp, self.dp), ("pp", pp, self.pp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise IndexError(f"{name} rank {value} out of range [0, {size})")
        return rank_of(dp, pp, tp, self.tp, self.pp)

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range [0, {self.world_size})")
        return tuple(rank_coords(rank, self.tp, self.pp))

    # ------------------------------------------------------------------ views
    @property
    def replicas(self) -> list[tuple[str, ...]]:
        """Nodes of each replica (index = dp_rank), in stage order, without repeats."""
        out: list[list[str]] = [[] for _ in range(self.dp)]
        for r in self.ranks:
            if r.node not in out[r.dp_rank]:
                out[r.dp_rank].append(r.node)
        return [tuple(nodes) for nodes in out]

    @property
    def nodes(self) -> list[str]:
        """Nodes in use, in order of their first rank."""
        return list(self.bundles_per_node())

    def bundles_per_node(self) -> dict[str, int]:
        """Workers (placement-group bundles) per node, nodes in order of their first rank."""
        out: dict[str, int] = {}
        for r in self.ranks:
            out[r.node] = out.get(r.node, 0) + 1
        return out

    def ranks_on_node(self, node: str) -> list[int]:
        return [r.rank for r in self.ranks if r.node == node]

    def tp_groups(self) -> list[list[RankPlacement]]:
        """One list of tp placements per (dp_rank, pp_rank), in rank order."""
        return [list(self.ranks[i : i + self.tp]) for i in range(0, len(self.ranks), self.tp)]

    @property
    def cross_rack_dp_ranks(self) -> list[int]:
        return [d for d, nodes in enumerate(self.replicas) if len({self.node_racks.get(n) for n in nodes}) > 1]

    @property
    def cross_node_tp(self) -> bool:
        return any(len({r.node for r in g}) > 1 for g in self.tp_groups())

    def ring_rack_crossings(self) -> int:
        """Most rack-to-rack hops of any DP ring (one ring per (pp_rank, tp_rank))."""
        if self.dp < 2:
            return 0
        worst = 0
        for pp in range(self.pp):
            for tp in range(self.tp):
                racks = [self.node_racks.get(self.ranks[self.rank_of(d, pp, tp)].node) for d in range(self.dp)]
                worst = max(worst, sum(racks[i] != racks[(i + 1) % self.dp] for i in range(self.dp)))
        return worst

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ranks": [r.to_dict() for r in self.ranks]}

    def to_json(self, indent: int | None = None) -> str:
        """The ``elastic plan --json`` document (``docs/cli.md``)."""
        return json.dumps(self.to_dict(), indent=indent)

    def to_table(self) -> str:
        """One row per TP group: where each (dp_rank, pp_rank) runs."""
        lines = [
            f"dp={self.dp} tp={self.tp} pp={self.pp} world_size={self.world_size} "
            f"mesh={self.mesh_dim_names} max_replicas={self.max_replicas} "
            f"ring_rack_crossings={self.ring_rack_crossings()}",
            f"{'dp':>4} {'pp':>4}  {'ranks':<13} {'rack':<10} nodes",
        ]
        for group in self.tp_groups():
            first, last = group[0], group[-1]
            ranks = str(first.rank) if first is last else f"{first.rank}-{last.rank}"
            nodes = list(dict.fromkeys(r.node for r in group))
            racks = ",".join(dict.fromkeys(str(self.node_racks.get(n) or "-") for n in nodes))
            lines.append(f"{first.dp_rank:>4} {first.pp_rank:>4}  {ranks:<13} {racks:<10} {','.join(nodes)}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _replica_groups(self) -> list[list[TPGroup]]:
        groups = [tuple(r.node for r in g) for g in self.tp_groups()]
        return [groups[d * self.pp : (d + 1) * self.pp] for d in range(self.dp)]


# ---------------------------------------------------------------------- planning


def plan_layout(
    topology: ClusterTopology,
    tp: int,
    pp: int,
    min_dp: int = 1,
    max_dp: int | None = None,
    allowed_dps: Iterable[int] | None = None,
    slots_per_worker: float = 1,
    device: str = "cuda",
    *,
    allow_cross_node_tp: bool = False,
    cpus_per_worker: float = 0,
    custom: dict[str, float] | None = None,
) -> LayoutPlan:
    """Place ``dp`` whole replicas of ``tp * pp`` workers on ``topology``; see the module doc.

    ``slots_per_worker`` is the device resource of one worker (GPUs on cuda, CPUs on cpu);
    ``cpus_per_worker`` and ``custom`` are extra needs that can also limit a node.
    """
    allowed_dps = None if allowed_dps is None else tuple(sorted(set(allowed_dps)))
    _check_request(tp, pp, min_dp, max_dp, allowed_dps, device, allow_cross_node_tp)
    slots = {n.name: n.worker_slots(device, slots_per_worker, cpus_per_worker, custom) for n in topology}
    nodes = [n for n in _rack_major(topology) if slots[n.name] > 0]
    if not nodes:
        raise InfeasibleError("resources", f"no node has room for a worker ({_need(device, slots_per_worker)})")
    racks = {n.name: n.rack for n in topology}

    tp_groups = _tp_groups(nodes, slots, tp, device, allow_cross_node_tp)
    if not tp_groups:
        raise InfeasibleError("parallel.tp", _tp_too_big(nodes, slots, tp, device, allow_cross_node_tp))
    replicas = _replicas(tp_groups, pp, racks)

    fit = _allowed(min_dp, max_dp, allowed_dps, cap=len(replicas))
    if not fit:
        raise InfeasibleError(
            "elastic.min_dp" if len(replicas) < min_dp else "train.global_batch",
            f"only {len(replicas)} whole replica(s) of tp*pp={tp * pp} workers fit "
            f"({sum(slots.values())} worker slots on {len(nodes)} node(s)), "
            f"but DP must be {_describe_allowed(min_dp, max_dp, allowed_dps)}",
        )
    dp = max(fit)
    chosen = _choose(replicas, dp, racks)
    notes = []
    idle = sum(slots.values()) - dp * tp * pp
    if idle:
        notes.append(f"{idle} worker slot(s) left idle")
    return _build(chosen, tp, pp, device, racks, len(replicas), min_dp, max_dp, allowed_dps, notes)


def inner_groupings(tp: int, pp: int, ep: int = 1, cp: int = 1) -> list[tuple[int, int]]:
    """Ways to plan a replica of ``pp x ep x cp x tp`` ranks as ``(group, stages)`` for
    :func:`plan_layout`, the one keeping the most inside a node first.

    The replica's rank order is ``(pp, ep, cp, tp)`` (``elastic/parallel/dims.py``), so any
    run of consecutive ranks of size ``tp*cp*ep``, ``tp*cp`` or ``tp`` is one group: EP and
    CP groups go inside a node with their TP group when they fit, then CP alone (its
    all-gathers are the finer grained), then neither (TP alone stays strict on GPUs).
    """
    return list(dict.fromkeys([(tp * cp * ep, pp), (tp * cp, pp * ep), (tp, pp * ep * cp)]))


def plan_groups(topology: ClusterTopology, tp: int, pp: int, ep: int = 1, cp: int = 1, **kwargs: Any) -> LayoutPlan:
    """:func:`plan_layout` for a layout with EP and CP: the first feasible of ``inner_groupings``.

    With ``ep`` or ``cp`` above 1 the plan's ``tp`` is the size of the in-node group it kept
    together and its ``pp`` the number of such groups per replica.
    """
    last: InfeasibleError | None = None
    for group, stages in inner_groupings(tp, pp, ep, cp):
        try:
            plan = plan_layout(topology, group, stages, **kwargs)
        except InfeasibleError as exc:
            last = exc
            continue
        if ep * cp == 1:
            return plan
        note = (
            f"parallel.ep={ep} x parallel.cp={cp} x parallel.tp={tp}: tp={group} is the group of ranks kept in "
            f"one node, pp={stages} the groups per replica (rank order dp, pp={pp}, ep, cp, tp; docs/parallelism.md)"
        )
        return replace(plan, notes=(*plan.notes, note))
    raise last


def plan_from_spec(spec: Any, topology: ClusterTopology, *, allow_cross_node_tp: bool | None = None) -> LayoutPlan:
    """Plan for a ``jobs.JobSpec``-like object (duck-typed: elastic never imports jobs).

    ``allow_cross_node_tp`` defaults to True on cpu (gloo has no NVLink to protect, and
    local multi-node tests run TP groups over single-CPU nodes) and False on cuda. A cpu
    job that asks for GPUs (``gpus_per_worker > 0``, logical GPUs declared by the nodes)
    is placed exactly like a GPU job: by GPUs, TP groups inside one node or NVLink domain.
    """
    args = spec_placement_args(spec)
    if allow_cross_node_tp is not None:
        args["allow_cross_node_tp"] = allow_cross_node_tp
    p = spec.parallel
    plan = plan_groups(
        topology,
        tp=p.tp,
        pp=p.pp,
        ep=getattr(p, "ep", 1),
        cp=getattr(p, "cp", 1),
        min_dp=spec.elastic.min_dp,
        max_dp=spec.elastic.max_dp,
        allowed_dps=spec.allowed_dps(),
        **args,
    )
    return plan if plan.device == spec.resources.device else replace(plan, device=spec.resources.device)


def spec_placement_args(spec: Any) -> dict[str, Any]:
    """The worker size of a spec as :func:`plan_layout` keywords (see :func:`plan_from_spec`)."""
    res = spec.resources
    by_gpu = res.device == "cuda" or res.gpus_per_worker > 0
    per_worker = res.gpus_per_worker if by_gpu else res.cpus_per_worker
    if per_worker <= 0:
        key = "gpus_per_worker" if by_gpu else "cpus_per_worker"
        raise SpecError(f"resources.{key}", f"must be > 0 to plan a {res.device} layout")
    return {
        "slots_per_worker": per_worker,
        "device": "cuda" if by_gpu else "cpu",
        "allow_cross_node_tp": not by_gpu,
        "cpus_per_worker": res.cpus_per_worker if by_gpu else 0,
        "custom": dict(res.custom or {}),
    }


def drop_nodes(target: LayoutPlan | ClusterTopology, lost_nodes: Iterable[str]) -> Any:
    """Remove lost nodes.

    * On a topology: the topology without them (re-plan it with :func:`plan_layout`).
    * On a plan: the surviving layout. Exactly the replicas that touched a lost node go;
      the others keep their nodes and their relative order and are renumbered. If the
      survivors are not an allowed DP degree, the last ones are dropped down to the
      largest allowed one. Raises :class:`InfeasibleError` below ``min_dp``.
    """
    lost = set(lost_nodes)
    if isinstance(target, ClusterTopology):
        return target.without(lost)
    plan = target
    groups = plan._replica_groups()
    survivors = [d for d, g in enumerate(groups) if not lost & {n for grp in g for n in grp}]
    fit = _allowed(plan.min_dp, plan.max_dp, plan.allowed_dps, cap=len(survivors))
    if not fit:
        raise InfeasibleError(
            "elastic.min_dp",
            f"losing {sorted(lost)} leaves {len(survivors)} whole replica(s); "
            f"DP must be {_describe_allowed(plan.min_dp, plan.max_dp, plan.allowed_dps)}",
        )
    kept = survivors[: max(fit)]
    notes = [f"dropped dp_rank(s) {[d for d in range(plan.dp) if d not in kept]} after losing {sorted(lost)}"]
    new = _build(
        [groups[d] for d in kept],
        plan.tp,
        plan.pp,
        plan.device,
        plan.node_racks,
        len(survivors),
        plan.min_dp,
        plan.max_dp,
        plan.allowed_dps,
        notes,
    )
    return replace(new, origin_dp_ranks=tuple(kept))


# ---------------------------------------------------------------------- internals


def _check_request(tp, pp, min_dp, max_dp, allowed_dps, device, cross) -> None:
    for name, value in (("parallel.tp", tp), ("parallel.pp", pp), ("elastic.min_dp", min_dp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(name, f"must be an integer >= 1, got {value!r}")
    if max_dp is not None and max_dp < min_dp:
        raise SpecError("elastic.max_dp", f"{max_dp} is smaller than elastic.min_dp ({min_dp})")
    if device not in ("cuda", "cpu"):
        raise SpecError("resources.device", f"must be 'cuda' or 'cpu', got {device!r}")
    if cross and device == "cuda":
        raise SpecError("allow_cross_node_tp", "only for device 'cpu': GPU TP groups stay inside one NVLink domain")
    if allowed_dps is not None and not _allowed(min_dp, max_dp, allowed_dps, cap=max_dp or max(allowed_dps, default=0)):
        raise InfeasibleError(
            "train.global_batch", f"no allowed DP degree {list(allowed_dps)} lies in [{min_dp}, {max_dp}]"
        )


def _allowed(min_dp: int, max_dp: int | None, allowed_dps: Sequence[int] | None, cap: int) -> list[int]:
    """Allowed DP degrees up to ``cap`` (the replicas that fit), ascending."""
    hi = cap if max_dp is None else min(cap, max_dp)
    if allowed_dps is None:
        return list(range(min_dp, hi + 1))
    return [d for d in allowed_dps if min_dp <= d <= hi]


def _describe_allowed(min_dp: int, max_dp: int | None, allowed_dps: Sequence[int] | None) -> str:
    bounds = f"in [{min_dp}, {'inf' if max_dp is None else max_dp}]"
    return bounds if allowed_dps is None else f"{bounds} and one of {list(allowed_dps)}"


def _need(device: str, per_worker: float) -> str:
    return f"{per_worker:g} {'GPU' if device == 'cuda' else 'CPU'} per worker"


def _rack_major(topology: ClusterTopology) -> list[NodeInfo]:
    """Nodes grouped by rack (racks in order of first appearance), file order inside."""
    return [topology.node(name) for names in topology.racks().values() for name in names]


def _pack(items: list[T], size: int, levels: list[Callable[[T], Hashable | None]]) -> list[tuple[list[T], int]]:
    """Cut ``items`` into groups of ``size``, innermost level first.

    At each level, the items still unused are bucketed by the level's key (``None``: the
    item cannot be pooled at this level) and each bucket is cut into consecutive groups;
    its remainder passes to the next level. Returns ``(group, level)`` pairs.
    """
    remaining = list(enumerate(items))
    groups: list[tuple[list[T], int]] = []
    for level, key in enumerate(levels):
        buckets: dict[Hashable, list[tuple[int, T]]] = {}
        left: list[tuple[int, T]] = []
        for pair in remaining:
            k = key(pair[1])
            (left if k is None else buckets.setdefault(k, [])).append(pair)
        for bucket in buckets.values():
            cut = len(bucket) // size * size
            groups += [([it for _, it in bucket[i : i + size]], level) for i in range(0, cut, size)]
            left += bucket[cut:]
        remaining = sorted(left, key=lambda pair: pair[0])
    return groups


def _tp_groups(nodes: list[NodeInfo], slots: dict[str, int], tp: int, device: str, cross: bool) -> list[TPGroup]:
    by_name = {n.name: n for n in nodes}
    items = [n.name for n in nodes for _ in range(slots[n.name])]
    levels: list[Callable[[str], Hashable | None]] = [lambda name: name]
    if device == "cuda":
        levels.append(lambda name: by_name[name].labels.get(NVLINK_DOMAIN))
    elif cross:
        levels += [lambda name: ("rack", by_name[name].rack), lambda name: "*"]
    position = {name: i for i, name in enumerate(by_name)}
    groups = [tuple(g) for g, _ in _pack(items, tp, levels)]
    return sorted(groups, key=lambda g: (position[g[0]], g))


@dataclass(frozen=True)
class _Replica:
    groups: tuple[TPGroup, ...]
    level: int  # 0: one node, 1: one rack, 2: spans racks
    index: int
    home_rack: str | None
    cross_rack: bool


def _replicas(groups: list[TPGroup], pp: int, racks: dict[str, str | None]) -> list[_Replica]:
    def one_node(g: TPGroup) -> Hashable | None:
        return g[0] if len(set(g)) == 1 else None

    def one_rack(g: TPGroup) -> Hashable | None:
        rs = {racks[n] for n in g}
        return ("rack", rs.pop()) if len(rs) == 1 else None

    packed = _pack(groups, pp, [one_node, one_rack, lambda g: "*"])
    out = []
    for i, (grps, level) in enumerate(packed):
        nodes = [n for g in grps for n in g]
        out.append(_Replica(tuple(grps), level, i, racks[nodes[0]], len({racks[n] for n in nodes}) > 1))
    return out


def _choose(replicas: list[_Replica], dp: int, racks: dict[str, str | None]) -> list[list[TPGroup]]:
    """Pick ``dp`` replicas (fullest racks first) and order them rack by rack."""
    first_seen = {r: i for i, r in enumerate(dict.fromkeys(racks.values()))}
    capacity: dict[str | None, int] = {}
    for rep in replicas:
        if not rep.cross_rack:
            capacity[rep.home_rack] = capacity.get(rep.home_rack, 0) + 1
    rack_rank = {r: (-capacity.get(r, 0), first_seen[r]) for r in first_seen}
    preferred = sorted(replicas, key=lambda p: (p.cross_rack, rack_rank[p.home_rack], p.level, p.index))[:dp]
    ring = sorted(preferred, key=lambda p: (rack_rank[p.home_rack], p.cross_rack, p.level, p.index))
    return [list(p.groups) for p in ring]


def _build(replicas, tp, pp, device, racks, max_replicas, min_dp, max_dp, allowed_dps, notes) -> LayoutPlan:
    ranks = []
    for dp_rank, groups in enumerate(replicas):
        for pp_rank, group in enumerate(groups):
            for tp_rank, node in enumerate(group):
                ranks.append(RankPlacement(len(ranks), node, dp_rank, pp_rank, tp_rank))
    plan = LayoutPlan(
        dp=len(replicas),
        tp=tp,
        pp=pp,
        ranks=tuple(ranks),
        device=device,
        node_racks=dict(racks),
        max_replicas=max_replicas,
        min_dp=min_dp,
        max_dp=max_dp,
        allowed_dps=allowed_dps,
    )
    crossing = plan.cross_rack_dp_ranks
    if crossing:
        notes.append(f"dp_rank(s) {crossing} span racks: not enough room inside one rack")
    if plan.cross_node_tp:
        why = "inside shared NVLink domains" if device == "cuda" else "allow_cross_node_tp"
        notes.append(f"TP groups span nodes ({why})")
    return replace(plan, notes=tuple(notes))


def _tp_too_big(nodes, slots, tp, device, cross) -> str:
    unit = "worker slots"
    if cross:
        return f"tp={tp} needs {tp} {unit} but the whole cluster has {sum(slots.values())}"
    domains: dict[str, int] = {}
    for n in nodes:
        key = n.labels.get(NVLINK_DOMAIN, f"node {n.name}") if device == "cuda" else n.name
        domains[key] = domains.get(key, 0) + slots[n.name]
    best = max(domains, key=domains.get)
    where = "NVLink domain" if device == "cuda" else "node"
    return (
        f"tp={tp} is larger than any {where}'s {unit} (largest: {domains[best]} on {best}); "
        f"TP groups must stay inside one {where}"
    )
