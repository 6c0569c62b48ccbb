"""Topology file parsing, validation errors and the ray.nodes() adapter (pure, no Ray)."""

from __future__ import annotations

import pytest

from elastic.errors import SpecError
from elastic.placement.topology import (
    ClusterTopology,
    NodeInfo,
    load_topology_file,
    topology_from_dict,
    topology_from_ray,
)


def _write(tmp_path, text: str):
    path = tmp_path / "topo.yaml"
    path.write_text(text)
    return path


def test_load_design_example(tmp_path):
    topo = load_topology_file(
        _write(
            tmp_path,
            """
nodes:
  - {name: n0, gpus: 8, labels: {rack: r0}}
  - {name: n1, gpus: 8, cpus: 96, labels: {rack: r0, nvlink_domain: nvl0}}
  - {name: n2, cpus: 4, slots: 2, resources: {trainer: 1}}
""",
        )
    )
    assert topo.names == ["n0", "n1", "n2"]
    n0, n1, n2 = topo.nodes
    assert (n0.gpus, n0.cpus, n0.rack, n0.nvlink_domain) == (8, None, "r0", "node:n0")
    assert (n1.cpus, n1.nvlink_domain) == (96, "nvl0")
    assert n2.rack is None and n2.slots == 2 and n2.resources == {"trainer": 1}
    assert topo.racks() == {"r0": ["n0", "n1"], None: ["n2"]}
    assert topology_from_dict(topo.to_dict()) == topo


def test_label_values_become_strings(tmp_path):
    topo = load_topology_file(_write(tmp_path, "nodes: [{name: a, gpus: 1, labels: {rack: 7}}]"))
    assert topo.nodes[0].rack == "7"


@pytest.mark.parametrize(
    "text, field",
    [
        ("nodes: []", "nodes"),
        ("{}", "nodes"),
        ("- a", "topology"),
        ("nodes: [{name: a}]\nextra: 1", "extra"),
        ("nodes: [{gpus: 8}]", "nodes[0].name"),
        ("nodes: [{name: a, gpus: 8}, {name: b, gpus: -1}]", "nodes[1].gpus"),
        ("nodes: [{name: a, gpus: eight}]", "nodes[0].gpus"),
        ("nodes: [{name: a, cpus: true}]", "nodes[0].cpus"),
        ("nodes: [{name: a, slots: 1.5}]", "nodes[0].slots"),
        ("nodes: [{name: a, gpu: 8}]", "nodes[0].gpu"),
        ("nodes: [{name: a, labels: [rack]}]", "nodes[0].labels"),
        ("nodes: [{name: a, labels: {rack: null}}]", "nodes[0].labels.rack"),
        ("nodes: [{name: a, resources: {x: -2}}]", "nodes[0].resources.x"),
        ("nodes: [{name: a}, {name: a}]", "nodes[1].name"),
        ("nodes: [3]", "nodes[0]"),
        ("nodes: [{name: a", "topology"),
    ],
)
def test_invalid_files_name_the_field(tmp_path, text, field):
    with pytest.raises(SpecError) as info:
        load_topology_file(_write(tmp_path, text))
    assert info.value.field == field


def test_missing_file(tmp_path):
    with pytest.raises(SpecError) as info:
        load_topology_file(tmp_path / "nope.yaml")
    assert info.value.field == "topology"


@pytest.mark.parametrize(
    "node, device, per_worker, cpus_per_worker, custom, slots",
    [
        (NodeInfo("a", gpus=8, cpus=96), "cuda", 1, 0, None, 8),
        (NodeInfo("a", gpus=8, cpus=96), "cuda", 2, 0, None, 4),
        (NodeInfo("a", gpus=8, cpus=12), "cuda", 1, 4, None, 3),  # CPUs limit GPU workers
        (NodeInfo("a", gpus=8), "cuda", 1, 4, None, 8),  # cpus unknown: no CPU limit
        (NodeInfo("a", gpus=1), "cuda", 0.1, 0, None, 10),  # fractional GPUs
        (NodeInfo("a", gpus=8, cpus=96), "cpu", 8, 0, None, 12),
        (NodeInfo("a", gpus=8), "cpu", 1, 0, None, 0),
        (NodeInfo("a", cpus=4, resources={"trainer": 2}), "cpu", 1, 0, {"trainer": 1}, 2),
        (NodeInfo("a", cpus=4), "cpu", 1, 0, {"trainer": 1}, 0),
        (NodeInfo("a", cpus=4, slots=1), "cpu", 1, 0, None, 1),  # explicit override
    ],
)
def test_worker_slots(node, device, per_worker, cpus_per_worker, custom, slots):
    assert node.worker_slots(device, per_worker, cpus_per_worker, custom) == slots


def test_worker_slots_rejects_zero_size():
    with pytest.raises(SpecError):
        NodeInfo("a", cpus=4).worker_slots("cpu", 0)


def _ray_node(node_id, cpus=1.0, gpus=0.0, alive=True, labels=None, **resources):
    res = {"CPU": cpus, "memory": 1e9, "object_store_memory": 1e8, "node:127.0.0.1": 1.0, **resources}
    if gpus:
        res["GPU"] = gpus
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeName": "127.0.0.1",
        "NodeManagerAddress": "127.0.0.1",
        "Resources": res,
        "Labels": {"ray.io/node-id": node_id, **(labels or {})},
    }


def test_topology_from_ray_labels_resources_and_names():
    nodes = [
        {**_ray_node("aaaa" * 14, cpus=0.0), "Resources": {"node:__internal_head__": 1.0}},  # head, no CPU
        _ray_node("bbbb" * 14, labels={"rack": "r0", "nvlink_domain": "d0", "name": "w1"}),
        _ray_node("cccc" * 14, **{"rack:r1": 1.0, "nvlink_domain_d1": 1.0, "trainer": 2.0}),
        _ray_node("dddd" * 14, labels={"rack": "r9"}, **{"rack:r2": 1.0}),  # label wins over resource
        _ray_node("eeee" * 14, alive=False),
    ]
    topo = topology_from_ray(nodes)
    # Sorted by name: ray.nodes() has no stable order.
    assert topo.names == ["127.0.0.1-aaaaaaaa", "127.0.0.1-cccccccc", "127.0.0.1-dddddddd", "w1"]
    head, c, d, w1 = topo.nodes
    assert head.cpus == 0 and head.worker_slots("cpu") == 0
    assert (w1.rack, w1.nvlink_domain, w1.cpus, w1.gpus) == ("r0", "d0", 1, 0)
    assert (c.rack, c.nvlink_domain, c.resources["trainer"]) == ("r1", "d1", 2.0)
    assert "node:127.0.0.1" not in c.resources and "CPU" not in c.resources
    assert d.rack == "r9"
    assert w1.node_id == "bbbb" * 14 and w1.ip == "127.0.0.1"
    assert "ray.io/node-id" not in w1.labels  # kept as node_id instead


def test_topology_from_ray_natural_name_order():
    nodes = [_ray_node(f"{i:056x}", labels={"name": f"w{i}"}) for i in (10, 2, 1)]
    assert topology_from_ray(nodes).names == ["w1", "w2", "w10"]


def test_topology_from_ray_unique_node_names_kept():
    a = {**_ray_node("a" * 56, gpus=8.0), "NodeName": "10.0.0.1"}
    b = {**_ray_node("b" * 56, gpus=8.0), "NodeName": "10.0.0.2"}
    topo = topology_from_ray([a, b])
    assert topo.names == ["10.0.0.1", "10.0.0.2"]
    assert [n.gpus for n in topo] == [8, 8]


def test_duplicate_names_refused():
    with pytest.raises(SpecError):
        ClusterTopology([NodeInfo("a"), NodeInfo("a")])


def test_without():
    topo = ClusterTopology([NodeInfo("a"), NodeInfo("b"), NodeInfo("c")])
    assert topo.without(["b", "zzz"]).names == ["a", "c"]
