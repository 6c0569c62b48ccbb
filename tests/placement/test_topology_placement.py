"""Pure parts of placement by plan (no Ray): plan -> bundles and label selectors, free capacity,
the ``placement`` event. The labelled-cluster run is tests/placement/test_topology_placement_cluster.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic.errors import SpecError
from elastic.parallel.dims import rank_coords
from elastic.placement.planned import (
    NODE_ID_LABEL,
    placement_fields,
    placement_group_args,
    plan_free_capacity,
    replica_nodes,
    ring_rack_crossings,
)
from elastic.placement.planner import plan_from_spec
from elastic.placement.topology import ClusterTopology, NodeInfo


def _spec(tp=2, pp=2, gpus=2.0, cpus=1.0, device="cpu", min_dp=1, max_dp=4):
    return SimpleNamespace(
        parallel=SimpleNamespace(tp=tp, pp=pp),
        elastic=SimpleNamespace(min_dp=min_dp, max_dp=max_dp),
        resources=SimpleNamespace(device=device, gpus_per_worker=gpus, cpus_per_worker=cpus, custom={}),
        allowed_dps=lambda: list(range(1, 9)),
    )


def _cluster(names=("w0", "w1", "w2", "w3"), gpus=4, cpus=2) -> ClusterTopology:
    """Like the rack_cluster fixture: w0, w1 in r0; w2, w3 (and w4, w5...) in r1."""
    rack = {"w0": "r0", "w1": "r0"}
    return ClusterTopology(
        NodeInfo(name=n, gpus=gpus, cpus=cpus, labels={"rack": rack.get(n, "r1")}, node_id=f"id-{n}") for n in names
    )


def test_bundle_b_is_pinned_to_the_planned_node_of_rank_b():
    plan = plan_from_spec(_spec(max_dp=2), _cluster())
    replicas = replica_nodes(plan, _cluster())
    # One TP group per node (2 logical GPUs per worker on 4-GPU nodes), a replica per rack.
    assert replicas == [("id-w0", "id-w0", "id-w1", "id-w1"), ("id-w2", "id-w2", "id-w3", "id-w3")]
    for d, nodes in enumerate(replicas):
        for b, node in enumerate(nodes):  # bundle b of replica d is rank d*4 + b
            rank = d * 4 + b
            assert plan.ranks[rank].node == node.removeprefix("id-")
            assert rank_coords(rank, 2, 2)[1:] == (plan.ranks[rank].pp_rank, plan.ranks[rank].tp_rank)
    labels = {f"id-w{i}": {"rack": "r0" if i < 2 else "r1"} for i in range(4)}
    args = placement_group_args(replicas[1], labels, {"CPU": 1.0, "GPU": 2.0})
    assert args == {
        "bundles": [{"CPU": 1.0, "GPU": 2.0}] * 4,
        "bundle_label_selector": [{NODE_ID_LABEL: n} for n in replicas[1]],
        "topology_strategy": {"rack": "STRICT_PACK"},  # the replica's rack, as a Ray rule too
    }


def test_no_rack_rule_across_racks_or_without_rack_labels():
    labels = {"a": {"rack": "r0"}, "b": {"rack": "r1"}, "c": {}}
    across = placement_group_args(["a", "b"], labels, {"CPU": 1.0})
    assert across["strategy"] == "PACK" and "topology_strategy" not in across
    assert placement_group_args(["c", "c"], labels, {"CPU": 1.0})["strategy"] == "PACK"


def test_free_capacity_subtracts_what_the_job_holds_and_skips_lost_nodes():
    spec, topo = _spec(), _cluster()
    held = {"id-w0": 2, "id-w1": 2}  # replica 0 on r0
    plan = plan_free_capacity(spec, topo, held, excluded=[], count=4)
    assert replica_nodes(plan, topo) == [("id-w2", "id-w2", "id-w3", "id-w3")]
    # w2 lost: r1 keeps one TP group's room, not a whole replica.
    assert plan_free_capacity(spec, topo, held, excluded=["id-w2"], count=4) is None
    # A node joins r1: the replica comes back in r1, on the survivor and the new node.
    grown = _cluster(("w0", "w1", "w2", "w3", "w4"))
    plan = plan_free_capacity(spec, grown, {**held, "id-w3": 0}, excluded=["id-w2"], count=1)
    assert replica_nodes(plan, grown) == [("id-w3", "id-w3", "id-w4", "id-w4")]
    assert plan_free_capacity(spec, topo, {}, [], count=0) is None


def test_logical_gpus_on_cpu_place_like_gpus():
    topo = _cluster()
    plan = plan_from_spec(_spec(gpus=1.0, cpus=0.5), topo)  # 4 workers per node by GPUs
    assert plan.device == "cpu" and plan.dp == 4 and not plan.cross_node_tp
    assert {len(set(n)) for n in replica_nodes(plan, topo)} == {1}  # a replica per node
    assert plan_from_spec(_spec(gpus=0.0, cpus=1.0), topo).dp == 2  # by CPUs: 2 workers per node
    with pytest.raises(SpecError) as info:
        plan_free_capacity(_spec(gpus=0.0, cpus=0.0), topo, {}, [], count=1)
    assert info.value.field == "resources.cpus_per_worker"


def test_ring_rack_crossings_and_placement_event():
    # dp 3, one rank per replica: the ring r0 -> r1 -> r0 -> (back to) r0 crosses racks twice.
    assert ring_rack_crossings(["r0", "r1", "r0"], dp=3, tp=1, pp=1) == 2
    assert ring_rack_crossings(["r0", "r0", "r1", "r1"], dp=2, tp=2, pp=1) == 2
    assert ring_rack_crossings(["r0", "r0"], dp=1, tp=2, pp=1) == 0
    members = [SimpleNamespace(rank=r, node_id=f"n{r // 2}", ip="10.0.0.1", pid=100 + r) for r in (3, 0, 2, 1)]
    labels = {"n0": {"rack": "r0"}, "n1": {"rack": "r1"}}
    event = placement_fields(1, 2, 2, members, labels)
    assert event["dp"] == 1 and event["ring_rack_crossings"] == 0
    assert event["ranks"][3] == {
        "rank": 3,
        "dp_rank": 0,
        "pp_rank": 1,
        "tp_rank": 1,
        "node_id": "n1",
        "node_ip": "10.0.0.1",
        "pid": 103,
        "labels": {"rack": "r1"},
    }
    assert [r["rank"] for r in event["ranks"]] == [0, 1, 2, 3]
