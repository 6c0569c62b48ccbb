"""The cluster as the planner sees it: nodes, their capacity and their place in the network.

A topology is plain data. It comes from one of two sources:

* a topology file (``docs/cli.md``, `elastic plan`), for ``elastic plan`` and for tests::

      nodes:
        - {name: n0, gpus: 8, cpus: 96, labels: {rack: r0, nvlink_domain: n0}}
        - {name: n1, gpus: 8, labels: {rack: r0}}

  Keys of a node: ``name`` (required, unique), ``gpus``, ``cpus``, ``slots`` (an explicit
  number of workers, overriding the computed one), ``resources`` (other Ray resources,
  e.g. ``{trainer: 1}``) and ``labels``. Unknown keys are refused.
* a live Ray cluster, through :func:`read_ray_topology` (the only function here that
  talks to Ray) or :func:`topology_from_ray` on ``ray.nodes()``-style dicts.

Labels the planner reads (``TOPOLOGY_LABELS``):

* ``rack``: the network locality group (a rack, or a leaf switch). Nodes without it share
  one unnamed rack.
* ``nvlink_domain``: the NVLink (scale-up) domain. Without it a node is its own domain,
  which is right for 8-GPU HGX boxes. Several nodes that share a value (a GB200 NVL72
  rack) form one domain, and a tensor-parallel group may span them.

On a live cluster a label comes, in order of precedence, from:

1. the node's Ray labels (``ray start --labels rack=r0``, or
   ``Cluster.add_node(labels={"rack": "r0"})``, both supported by Ray 2.60);
2. a custom resource named ``<key>:<value>`` or ``<key>_<value>`` for a key in
   ``TOPOLOGY_LABELS`` (``ray start --resources '{"rack:r0": 1}'``), for clusters that
   predate node labels.

A live node is named by its ``name`` label when it has one (``--labels name=w0``), which
gives readable, stable names to the many Ray nodes of a one-machine test cluster.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.errors import SpecError
from elastic.yaml_io import read_yaml

RACK = "rack"
NVLINK_DOMAIN = "nvlink_domain"
TOPOLOGY_LABELS: tuple[str, ...] = (RACK, NVLINK_DOMAIN)
# Node label a live cluster can use to give a node a stable, readable name.
NAME_LABEL = "name"

_NODE_KEYS = {"name", "gpus", "cpus", "slots", "resources", "labels"}
# Slack for float resources (0.1 GPU per worker x 10 workers).
_EPS = 1e-9


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node. ``cpus=None`` means "not stated": CPUs then never limit a GPU worker."""

    name: str
    gpus: float = 0
    cpus: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    node_id: str | None = None
    ip: str | None = None
    slots: int | None = None
    resources: dict[str, float] = field(default_factory=dict)

    @property
    def rack(self) -> str | None:
        return self.labels.get(RACK)

    @property
    def nvlink_domain(self) -> str:
        """The NVLink domain; a node without the label is a domain of its own."""
        return self.labels.get(NVLINK_DOMAIN) or f"node:{self.name}"

    def worker_slots(
        self,
        device: str = "cuda",
        per_worker: float = 1,
        cpus_per_worker: float = 0,
        custom: Mapping[str, float] | None = None,
    ) -> int:
        """How many workers of the given size fit on this node.

        ``per_worker`` is the device resource of one worker: GPUs when ``device`` is cuda,
        CPUs when it is cpu. ``cpus_per_worker`` adds a CPU need to a GPU worker and
        ``custom`` adds other Ray resources. An explicit ``slots`` wins over all of them.
        """
        if self.slots is not None:
            return self.slots
        if per_worker <= 0:
            raise SpecError("slots_per_worker", f"must be > 0, got {per_worker}")
        if device == "cuda":
            fits = [_count(self.gpus, per_worker)]
            if cpus_per_worker > 0 and self.cpus is not None:
                fits.append(_count(self.cpus, cpus_per_worker))
        elif device == "cpu":
            fits = [_count(self.cpus or 0, per_worker)]
        else:
            raise SpecError("resources.device", f"must be 'cuda' or 'cpu', got {device!r}")
        for name, need in (custom or {}).items():
            if need > 0:
                fits.append(_count(self.resources.get(name, 0), need))
        return min(fits)


def _count(have: float, need: float) -> int:
    return int(math.floor(have / need + _EPS))


@dataclass(frozen=True)
class ClusterTopology:
    """An ordered list of nodes. The order is kept: it breaks ties in the planner."""

    nodes: tuple[NodeInfo, ...]
    _by_name: dict[str, NodeInfo] = field(init=False, repr=False, compare=False)

    def __init__(self, nodes: Iterable[NodeInfo]):
        nodes = tuple(nodes)
        seen: set[str] = set()
        for i, node in enumerate(nodes):
            if node.name in seen:
                raise SpecError(f"nodes[{i}].name", f"duplicate node name {node.name!r}")
            seen.add(node.name)
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "_by_name", {n.name: n for n in nodes})  # node() in O(1): plans of 10k nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def node(self, name: str) -> NodeInfo:
        return self._by_name[name]

    def racks(self) -> dict[str | None, list[str]]:
        """Node names per rack, racks in order of first appearance."""
        out: dict[str | None, list[str]] = {}
        for n in self.nodes:
            out.setdefault(n.rack, []).append(n.name)
        return out

    def without(self, names: Iterable[str]) -> ClusterTopology:
        drop = set(names)
        return ClusterTopology(n for n in self.nodes if n.name not in drop)

    def to_dict(self) -> dict[str, Any]:
        """The topology-file form (round-trips through :func:`topology_from_dict`)."""
        rows = []
        for n in self.nodes:
            row: dict[str, Any] = {"name": n.name, "gpus": n.gpus}
            if n.cpus is not None:
                row["cpus"] = n.cpus
            if n.slots is not None:
                row["slots"] = n.slots
            if n.resources:
                row["resources"] = dict(n.resources)
            if n.labels:
                row["labels"] = dict(n.labels)
            rows.append(row)
        return {"nodes": rows}


# ---------------------------------------------------------------------- topology file


def load_topology_file(path: str | Path) -> ClusterTopology:
    """Read and validate a topology YAML file. Errors name the field (``nodes[2].gpus``)."""
    raw = read_yaml(path, "topology")
    return topology_from_dict(raw)


def topology_from_dict(raw: Any) -> ClusterTopology:
    if not isinstance(raw, dict):
        raise SpecError("topology", "must be a mapping with a 'nodes' list")
    unknown = sorted(set(raw) - {"nodes"})
    if unknown:
        raise SpecError(str(unknown[0]), "unknown key")
    rows = raw.get("nodes")
    if not isinstance(rows, list) or not rows:
        raise SpecError("nodes", "must be a non-empty list of nodes")
    return ClusterTopology(_node_from_dict(row, f"nodes[{i}]") for i, row in enumerate(rows))


def _node_from_dict(row: Any, where: str) -> NodeInfo:
    if not isinstance(row, dict):
        raise SpecError(where, "must be a mapping like {name: n0, gpus: 8}")
    unknown = sorted(set(map(str, row)) - _NODE_KEYS)
    if unknown:
        raise SpecError(f"{where}.{unknown[0]}", "unknown key")
    name = row.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{where}.name", "is required and must be a non-empty string")
    slots = row.get("slots")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 0):
        raise SpecError(f"{where}.slots", f"must be an integer >= 0, got {slots!r}")
    cpus = row.get("cpus")
    return NodeInfo(
        name=name,
        gpus=_amount(row.get("gpus", 0), f"{where}.gpus"),
        cpus=None if cpus is None else _amount(cpus, f"{where}.cpus"),
        labels=_labels(row.get("labels", {}), f"{where}.labels"),
        slots=slots,
        resources=_resources(row.get("resources", {}), f"{where}.resources"),
    )


def _amount(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or math.isnan(value):
        raise SpecError(where, f"must be a number >= 0, got {value!r}")
    return int(value) if float(value).is_integer() else float(value)


def _labels(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(where, "must be a mapping of label -> value")
    out = {}
    for key, val in value.items():
        if not isinstance(key, str) or not key:
            raise SpecError(where, f"label keys must be non-empty strings, got {key!r}")
        if isinstance(val, (dict, list)) or val is None:
            raise SpecError(f"{where}.{key}", f"must be a scalar, got {val!r}")
        out[key] = str(val)
    return out


def _resources(value: Any, where: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(where, "must be a mapping of resource -> amount")
    return {str(k): _amount(v, f"{where}.{k}") for k, v in value.items()}


# ---------------------------------------------------------------------- live cluster

# Ray's own resources that are not topology facts.
_RAY_BUILTIN = {"CPU", "GPU", "memory", "object_store_memory"}
_RAY_BUILTIN_PREFIXES = ("node:", "accelerator_type:")
_NODE_ID_LABEL = "ray.io/node-id"  # already in NodeInfo.node_id


def topology_from_ray(ray_nodes: Iterable[Mapping[str, Any]]) -> ClusterTopology:
    """Build a topology from ``ray.nodes()``-style dicts. Pure: pass the list in.

    Only alive nodes count, sorted by name (``ray.nodes()`` has no stable order; names
    compare digit runs as numbers, so w2 < w10). A node is named, in order of preference, by its ``name`` label,
    by its ``NodeName`` when that is unique among alive nodes, and otherwise by
    ``NodeName`` plus the first 8 characters of its node id (on one machine every
    ``NodeName`` is the same IP).
    """
    alive = [n for n in ray_nodes if n.get("Alive", n.get("alive", False))]
    base_names = [str(n.get("NodeName") or n.get("NodeManagerAddress") or "node") for n in alive]
    nodes: list[NodeInfo] = []
    for node, base in zip(alive, base_names):
        resources = {str(k): float(v) for k, v in (node.get("Resources") or {}).items()}
        labels = {str(k): str(v) for k, v in (node.get("Labels") or {}).items() if k != _NODE_ID_LABEL}
        for key, value in _labels_from_resources(resources).items():
            labels.setdefault(key, value)
        node_id = node.get("NodeID")
        if labels.get(NAME_LABEL):
            name = labels[NAME_LABEL]
        elif base_names.count(base) == 1:
            name = base
        else:
            name = f"{base}-{str(node_id or len(nodes))[:8]}"
        custom = {
            k: v for k, v in resources.items() if k not in _RAY_BUILTIN and not k.startswith(_RAY_BUILTIN_PREFIXES)
        }
        nodes.append(
            NodeInfo(
                name=name,
                gpus=_whole(resources.get("GPU", 0.0)),
                cpus=_whole(resources.get("CPU", 0.0)),
                labels=labels,
                node_id=node_id,
                ip=node.get("NodeManagerAddress"),
                resources=custom,
            )
        )
    return ClusterTopology(sorted(nodes, key=lambda n: _natural_key(n.name)))


def _natural_key(name: str) -> list[Any]:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def _labels_from_resources(resources: Mapping[str, float]) -> dict[str, str]:
    """Topology labels encoded as custom resources: ``rack:r0`` or ``rack_r0``."""
    out: dict[str, str] = {}
    for key in TOPOLOGY_LABELS:
        pattern = re.compile(rf"^{re.escape(key)}[:_](.+)$")
        for res in sorted(resources):
            m = pattern.match(res)
            if m and key not in out:
                out[key] = m.group(1)
    return out


def _whole(x: float) -> float:
    return int(x) if float(x).is_integer() else x


def read_ray_topology() -> ClusterTopology:  # pragma: no cover - thin Ray wrapper
    """The one effectful entry point: the topology of the Ray cluster this process joined."""
    import ray

    return topology_from_ray(ray.nodes())
