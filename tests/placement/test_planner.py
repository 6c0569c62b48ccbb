"""The rank layout planner: pure, checked against topologies small enough to reason about."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from elastic.errors import InfeasibleError, SpecError
from elastic.placement.planner import LayoutPlan, RankPlacement, drop_nodes, plan_from_spec, plan_layout
from elastic.placement.topology import ClusterTopology, NodeInfo


def gpu_cluster(racks=(("n0", "n1"), ("n2", "n3")), gpus=8, **extra_labels) -> ClusterTopology:
    """4 nodes x 8 GPUs in 2 racks by default."""
    return ClusterTopology(
        NodeInfo(name, gpus=gpus, labels={"rack": f"r{r}", **extra_labels})
        for r, names in enumerate(racks)
        for name in names
    )


def rack_of(topo: ClusterTopology):
    return {n.name: n.rack for n in topo}


def check_invariants(plan: LayoutPlan, topo: ClusterTopology, device="cuda"):
    """Everything that must hold for any plan."""
    assert plan.world_size == len(plan.ranks) == plan.dp * plan.pp * plan.tp
    for i, r in enumerate(plan.ranks):
        assert r.rank == i == plan.rank_of(r.dp_rank, r.pp_rank, r.tp_rank)
        assert plan.coords_of(i) == (r.dp_rank, r.pp_rank, r.tp_rank)
    used = plan.bundles_per_node()
    for name, count in used.items():
        assert count <= topo.node(name).worker_slots(device)
    assert sum(used.values()) == plan.world_size
    # Each TP group inside one node (the strict GPU rule).
    if device == "cuda":
        for group in plan.tp_groups():
            assert len({r.node for r in group}) == 1


# ---------------------------------------------------------------------- DP sizing


@pytest.mark.parametrize(
    "tp, pp, dp",
    [(8, 2, 2), (4, 4, 2), (4, 2, 4), (8, 1, 4), (2, 1, 16), (1, 2, 16), (1, 1, 32)],
)
def test_dp_is_whole_replicas_that_fit(tp, pp, dp):
    topo = gpu_cluster()
    plan = plan_layout(topo, tp=tp, pp=pp, min_dp=1, max_dp=64, allowed_dps=list(range(1, 65)))
    assert (plan.dp, plan.tp, plan.pp) == (dp, tp, pp)
    assert plan.max_replicas == dp
    check_invariants(plan, topo)


def test_replicas_inside_racks_and_stages_in_order():
    topo = gpu_cluster()
    plan = plan_layout(topo, tp=8, pp=2, min_dp=1, max_dp=64)
    racks = rack_of(topo)
    assert plan.replicas == [("n0", "n1"), ("n2", "n3")]
    assert plan.cross_rack_dp_ranks == []
    for nodes in plan.replicas:
        assert len({racks[n] for n in nodes}) == 1
    # Pipeline neighbours: stage 0 on the first node of the rack, stage 1 on the next.
    assert [r.node for r in plan.ranks if r.dp_rank == 0 and r.tp_rank == 0] == ["n0", "n1"]


def test_small_replicas_stay_node_local():
    topo = gpu_cluster()
    plan = plan_layout(topo, tp=2, pp=2, min_dp=1, max_dp=64)
    assert plan.dp == 8
    assert all(len(nodes) == 1 for nodes in plan.replicas)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (4, 2), (8, 2), (2, 3)])
def test_dp_ring_crosses_racks_minimally(tp, pp):
    # File order interleaves racks: a naive node-order layout would cross on every hop.
    topo = gpu_cluster(racks=(("n0", "n2"), ("n1", "n3")))
    topo = ClusterTopology(sorted(topo.nodes, key=lambda n: n.name))
    plan = plan_layout(topo, tp=tp, pp=pp, min_dp=1, max_dp=64)
    assert plan.dp > 1
    # Two racks: the ring leaves each rack once and comes back once.
    assert plan.ring_rack_crossings() == 2
    racks = rack_of(topo)
    ring = [racks[plan.ranks[plan.rank_of(d, 0, 0)].node] for d in range(plan.dp)]
    assert ring == sorted(ring)  # rack by rack


def test_single_rack_ring_never_crosses():
    topo = gpu_cluster(racks=(("n0", "n1", "n2", "n3"),))
    assert plan_layout(topo, tp=1, pp=1, min_dp=1, max_dp=64).ring_rack_crossings() == 0


def test_spill_across_racks_only_when_needed_and_flagged():
    # tp=2, pp=3: 4 TP groups per node -> 1 node-local replica + 1 leftover group per node.
    topo = gpu_cluster()
    plan = plan_layout(topo, tp=2, pp=3, min_dp=1, max_dp=64)
    assert plan.dp == 5  # floor(16 TP groups / 3)
    racks = rack_of(topo)
    spanning = [d for d, nodes in enumerate(plan.replicas) if len({racks[n] for n in nodes}) > 1]
    assert plan.cross_rack_dp_ranks == spanning and len(spanning) == 1
    assert any("span racks" in note for note in plan.notes)
    check_invariants(plan, topo)
    assert plan.ring_rack_crossings() == 2


def test_allowed_dps_pick_largest_allowed_and_fill_one_rack_first():
    # r0 holds 3 one-node replicas, r1 holds 4. DP must be 4: all of it fits in r1.
    topo = gpu_cluster(racks=(("a0", "a1", "a2"), ("b0", "b1", "b2", "b3")))
    plan = plan_layout(topo, tp=8, pp=1, min_dp=1, max_dp=64, allowed_dps=[1, 2, 4, 8])
    assert plan.dp == 4 and plan.max_replicas == 7
    assert sorted(plan.nodes) == ["b0", "b1", "b2", "b3"]
    assert plan.ring_rack_crossings() == 0
    assert any("idle" in note for note in plan.notes)


@pytest.mark.parametrize("max_dp, dp", [(3, 3), (64, 4), (None, 4)])
def test_max_dp_caps(max_dp, dp):
    assert plan_layout(gpu_cluster(), tp=8, pp=1, min_dp=1, max_dp=max_dp).dp == dp


# ---------------------------------------------------------------------- contract


def test_rank_order_is_dp_pp_tp_with_tp_fastest():
    plan = plan_layout(gpu_cluster(), tp=4, pp=2, min_dp=1, max_dp=64)
    assert plan.mesh_dim_names == ("dp", "pp", "tp")
    assert plan.ranks[0] == RankPlacement(0, "n0", 0, 0, 0)
    assert plan.ranks[1] == RankPlacement(1, "n0", 0, 0, 1)
    assert plan.ranks[4] == RankPlacement(4, "n0", 0, 1, 0)
    assert plan.ranks[8].dp_rank == 1 and plan.ranks[8].pp_rank == 0
    assert plan.rank_of(3, 1, 2) == ((3 * 2) + 1) * 4 + 2
    with pytest.raises(IndexError):
        plan.rank_of(4, 0, 0)


def test_to_json_matches_design():
    plan = plan_layout(gpu_cluster(gpus=1, racks=(("n0", "n1"),)), tp=1, pp=1, min_dp=1, max_dp=8)
    assert json.loads(plan.to_json()) == {
        "dp": 2,
        "tp": 1,
        "pp": 1,
        "ranks": [
            {"rank": 0, "node": "n0", "dp_rank": 0, "pp_rank": 0, "tp_rank": 0},
            {"rank": 1, "node": "n1", "dp_rank": 1, "pp_rank": 0, "tp_rank": 0},
        ],
    }
    assert list(json.loads(plan.to_json())) == ["dp", "tp", "pp", "ranks"]


def test_to_table_and_bundles():
    plan = plan_layout(gpu_cluster(), tp=4, pp=2, min_dp=1, max_dp=64)
    table = plan.to_table()
    assert "dp=4 tp=4 pp=2" in table and "n3" in table
    assert len(table.splitlines()) == 2 + plan.dp * plan.pp
    assert plan.bundles_per_node() == {"n0": 8, "n1": 8, "n2": 8, "n3": 8}
    assert plan.ranks_on_node("n1") == list(range(8, 16))
    assert [len(g) for g in plan.tp_groups()] == [4] * 8


# ---------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "tp, pp, lost, dp_after",
    [(4, 2, ["n1"], 3), (8, 2, ["n3"], 1), (1, 1, ["n0"], 24), (2, 1, ["n0", "n2"], 8)],
)
def test_losing_a_node_removes_exactly_its_replicas(tp, pp, lost, dp_after):
    topo = gpu_cluster()
    plan = plan_layout(topo, tp=tp, pp=pp, min_dp=1, max_dp=64)
    touched = [d for d, nodes in enumerate(plan.replicas) if set(nodes) & set(lost)]
    after = drop_nodes(plan, lost)
    assert after.dp == plan.dp - len(touched) == dp_after
    assert not set(after.nodes) & set(lost)
    # Survivors keep their nodes and their order.
    assert list(after.origin_dp_ranks) == [d for d in range(plan.dp) if d not in touched]
    assert after.replicas == [plan.replicas[d] for d in after.origin_dp_ranks]
    check_invariants(after, topo)
    # Re-planning the surviving topology finds the same number of replicas here.
    replanned = plan_layout(drop_nodes(topo, lost), tp=tp, pp=pp, min_dp=1, max_dp=64)
    assert replanned.dp == dp_after


def test_losing_a_node_of_a_cross_rack_replica():
    topo = gpu_cluster()
    plan = plan_layout(topo, tp=2, pp=3, min_dp=1, max_dp=64)
    [spill] = plan.cross_rack_dp_ranks
    lost = plan.replicas[spill][-1]  # in rack r1, shared with a node-local replica
    touched = [d for d, nodes in enumerate(plan.replicas) if lost in nodes]
    assert spill in touched and len(touched) == 2
    after = drop_nodes(plan, [lost])
    assert after.dp == plan.dp - 2 and after.cross_rack_dp_ranks == []


def test_drop_respects_allowed_dps_and_min_dp():
    topo = gpu_cluster()
    plan = plan_layout(topo, tp=4, pp=2, min_dp=2, max_dp=64, allowed_dps=[1, 2, 4])
    assert plan.dp == 4
    after = drop_nodes(plan, ["n0"])  # 3 survivors, 3 is not allowed -> 2
    assert after.dp == 2 and after.origin_dp_ranks == (1, 2)
    with pytest.raises(InfeasibleError) as info:
        drop_nodes(plan, ["n0", "n1", "n2"])
    assert info.value.field == "elastic.min_dp"


# ---------------------------------------------------------------------- infeasible


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (dict(tp=16, pp=1), "parallel.tp", "larger than any"),
        (dict(tp=8, pp=2, min_dp=3), "elastic.min_dp", "only 2 whole replica"),
        (dict(tp=8, pp=8), "elastic.min_dp", "only 0 whole replica"),
        (dict(tp=8, pp=1, allowed_dps=[5, 6]), "train.global_batch", "one of [5, 6]"),
        (dict(tp=8, pp=1, min_dp=1, max_dp=4, allowed_dps=[6, 8]), "train.global_batch", "no allowed DP"),
        (dict(tp=1, pp=1, slots_per_worker=16), "resources", "no node has room"),
    ],
)
def test_infeasible_requests(kwargs, field, words):
    with pytest.raises(InfeasibleError) as info:
        plan_layout(gpu_cluster(), **{"min_dp": 1, "max_dp": 64, **kwargs})
    assert info.value.field == field
    assert words in str(info.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tp=0, pp=1), "parallel.tp"),
        (dict(tp=1, pp=0), "parallel.pp"),
        (dict(tp=1, pp=1, min_dp=4, max_dp=2), "elastic.max_dp"),
        (dict(tp=1, pp=1, device="tpu"), "resources.device"),
        (dict(tp=2, pp=1, allow_cross_node_tp=True), "allow_cross_node_tp"),
    ],
)
def test_bad_arguments(kwargs, field):
    with pytest.raises(SpecError) as info:
        plan_layout(gpu_cluster(), **kwargs)
    assert info.value.field == field


def test_nvlink_domain_lets_gpu_tp_span_nodes():
    # GB200-style: 4-GPU nodes sharing one NVLink domain.
    nvl = ClusterTopology(NodeInfo(f"g{i}", gpus=4, labels={"rack": "r0", "nvlink_domain": "nvl0"}) for i in range(4))
    plan = plan_layout(nvl, tp=8, pp=1, min_dp=1, max_dp=8)
    assert plan.dp == 2 and plan.replicas == [("g0", "g1"), ("g2", "g3")]
    assert plan.cross_node_tp
    plain = ClusterTopology(NodeInfo(f"g{i}", gpus=4) for i in range(4))
    with pytest.raises(InfeasibleError, match="NVLink domain"):
        plan_layout(plain, tp=8, pp=1, min_dp=1, max_dp=8)


# ---------------------------------------------------------------------- CPU / local tests


def cpu_cluster(n=4, racks=None) -> ClusterTopology:
    return ClusterTopology(NodeInfo(f"c{i}", cpus=1, labels={"rack": racks[i]} if racks else {}) for i in range(n))


def test_cpu_tp_across_single_slot_nodes_needs_the_flag():
    with pytest.raises(InfeasibleError) as info:
        plan_layout(cpu_cluster(), tp=2, pp=1, min_dp=1, max_dp=4, device="cpu")
    assert info.value.field == "parallel.tp"
    plan = plan_layout(cpu_cluster(), tp=2, pp=1, min_dp=1, max_dp=4, device="cpu", allow_cross_node_tp=True)
    assert plan.dp == 2 and plan.cross_node_tp
    assert [[r.node for r in g] for g in plan.tp_groups()] == [["c0", "c1"], ["c2", "c3"]]
    check_invariants(plan, cpu_cluster(), device="cpu")
    assert drop_nodes(plan, ["c3"]).replicas == [("c0", "c1")]


def test_cpu_cross_node_tp_stays_in_rack_first():
    topo = cpu_cluster(racks=["r0", "r1", "r0", "r1"])
    plan = plan_layout(topo, tp=2, pp=1, min_dp=1, max_dp=4, device="cpu", allow_cross_node_tp=True)
    assert [set(g) for g in plan.replicas] == [{"c0", "c2"}, {"c1", "c3"}]


def test_zero_slot_head_node_is_ignored():
    topo = ClusterTopology([NodeInfo("head", cpus=0), *cpu_cluster(2).nodes])
    plan = plan_layout(topo, tp=1, pp=1, min_dp=1, max_dp=4, device="cpu")
    assert plan.dp == 2 and "head" not in plan.nodes


# ---------------------------------------------------------------------- from a job spec


def test_plan_from_real_job_spec():
    from jobs import JobSpec

    spec = JobSpec.from_dict(
        {
            "parallel": {"tp": 2, "micro_batch": 4},
            "elastic": {"min_dp": 1, "max_dp": 4},
            "train": {"global_batch": 16},
            "resources": {"device": "cpu", "cpus_per_worker": 1},
        }
    )
    plan = plan_from_spec(spec, cpu_cluster())  # cpu: cross-node TP allowed by default
    assert (plan.dp, plan.tp, plan.pp) == (2, 2, 1)


def _fake_spec(tp=8, pp=1, min_dp=1, max_dp=8, allowed=(1, 2, 4), device="cuda", gpus=1, cpus=0, custom=None):
    return SimpleNamespace(
        parallel=SimpleNamespace(tp=tp, pp=pp),
        elastic=SimpleNamespace(min_dp=min_dp, max_dp=max_dp),
        resources=SimpleNamespace(device=device, gpus_per_worker=gpus, cpus_per_worker=cpus, custom=custom or {}),
        allowed_dps=lambda: list(allowed),
    )


def test_plan_from_duck_typed_spec():
    topo = gpu_cluster()
    plan = plan_from_spec(_fake_spec(), topo)
    assert plan.dp == 4 and plan.allowed_dps == (1, 2, 4)
    assert plan.max_replicas == 4
    assert plan_from_spec(_fake_spec(tp=4, gpus=2), topo).max_replicas == 4  # 2 GPUs per worker
    assert plan_from_spec(_fake_spec(tp=4, gpus=1), topo).max_replicas == 8
    with pytest.raises(InfeasibleError):
        plan_from_spec(_fake_spec(custom={"trainer": 1}), topo)  # no node has 'trainer'
    with pytest.raises(SpecError) as info:
        plan_from_spec(_fake_spec(gpus=0), topo)
    assert info.value.field == "resources.gpus_per_worker"
