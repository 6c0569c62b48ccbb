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

The plan itself (``LayoutPlan``) is in ``layout_plan.py``, the greedy packing in
``packing.py``; this module decides and checks (runs on the driver, in ``elastic plan`` and
in the simulator).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, overload

from elastic.errors import InfeasibleError, SpecError
from elastic.placement import packing
from elastic.placement.layout_plan import MESH_DIM_NAMES, LayoutPlan, RankPlacement, TPGroup
from elastic.placement.topology import ClusterTopology, NodeInfo

# LayoutPlan and RankPlacement are imported from here by the CLI, the simulator and the tests.
__all__ = [
    "MESH_DIM_NAMES",
    "LayoutPlan",
    "RankPlacement",
    "drop_nodes",
    "inner_groupings",
    "plan_from_spec",
    "plan_groups",
    "plan_layout",
    "spec_placement_args",
]


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
    allowed = None if allowed_dps is None else tuple(sorted(set(allowed_dps)))
    _check_request(tp, pp, min_dp, max_dp, allowed, device, allow_cross_node_tp)
    slots = {n.name: n.worker_slots(device, slots_per_worker, cpus_per_worker, custom) for n in topology}
    nodes = [n for n in _rack_major(topology) if slots[n.name] > 0]
    if not nodes:
        raise InfeasibleError("resources", f"no node has room for a worker ({_need(device, slots_per_worker)})")
    racks = {n.name: n.rack for n in topology}

    tp_groups = packing.tp_groups(nodes, slots, tp, device, allow_cross_node_tp)
    if not tp_groups:
        raise InfeasibleError("parallel.tp", packing.tp_too_big(nodes, slots, tp, device, allow_cross_node_tp))
    replicas = packing.replicas(tp_groups, pp, racks)

    fit = _allowed(min_dp, max_dp, allowed, cap=len(replicas))
    if not fit:
        raise InfeasibleError(
            "elastic.min_dp" if len(replicas) < min_dp else "train.global_batch",
            f"only {len(replicas)} whole replica(s) of tp*pp={tp * pp} workers fit "
            f"({sum(slots.values())} worker slots on {len(nodes)} node(s)), "
            f"but DP must be {_describe_allowed(min_dp, max_dp, allowed)}",
        )
    dp = max(fit)
    chosen = packing.choose(replicas, dp, racks)
    notes = []
    idle = sum(slots.values()) - dp * tp * pp
    if idle:
        notes.append(f"{idle} worker slot(s) left idle")
    return _build(chosen, tp, pp, device, racks, len(replicas), min_dp, max_dp, allowed, notes)


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
    failures: list[InfeasibleError] = []
    for group, stages in inner_groupings(tp, pp, ep, cp):
        try:
            plan = plan_layout(topology, group, stages, **kwargs)
        except InfeasibleError as exc:
            failures.append(exc)
            continue
        if ep * cp == 1:
            return plan
        note = (
            f"parallel.ep={ep} x parallel.cp={cp} x parallel.tp={tp}: tp={group} is the group of ranks kept in "
            f"one node, pp={stages} the groups per replica (rank order dp, pp={pp}, ep, cp, tp; docs/parallelism.md)"
        )
        return replace(plan, notes=(*plan.notes, note))
    raise failures[-1]  # inner_groupings is never empty: the last grouping tried, the most spread out


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


@overload
def drop_nodes(target: LayoutPlan, lost_nodes: Iterable[str]) -> LayoutPlan: ...
@overload
def drop_nodes(target: ClusterTopology, lost_nodes: Iterable[str]) -> ClusterTopology: ...
def drop_nodes(target: LayoutPlan | ClusterTopology, lost_nodes: Iterable[str]) -> LayoutPlan | ClusterTopology:
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


def _check_request(
    tp: int,
    pp: int,
    min_dp: int,
    max_dp: int | None,
    allowed_dps: tuple[int, ...] | None,
    device: str,
    cross: bool,
) -> None:
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


def _build(
    replicas: Sequence[Sequence[TPGroup]],
    tp: int,
    pp: int,
    device: str,
    racks: dict[str, str | None],
    max_replicas: int,
    min_dp: int,
    max_dp: int | None,
    allowed_dps: tuple[int, ...] | None,
    notes: list[str],
) -> LayoutPlan:
    ranks: list[RankPlacement] = []
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
