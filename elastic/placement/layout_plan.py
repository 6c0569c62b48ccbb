"""The rank layout's document: where every rank of a plan runs, its views and its output (pure, no Ray).

Built by the planner (``planner.py``) on the driver and by the simulator; read by the
placement group builder (``planned.py``) and by ``elastic plan``. Rank order (the contract
with the runtime, which builds the ``DeviceMesh`` from it)::

    rank = ((dp_rank * pp) + pp_rank) * tp + tp_rank      # mesh dims ("dp", "pp", "tp")

``planner.py``'s module docstring says why dp is outermost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from elastic.parallel.dims import rank_coords, rank_of

MESH_DIM_NAMES: tuple[str, str, str] = ("dp", "pp", "tp")

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
        coords = rank_coords(rank, self.tp, self.pp)
        return (coords.dp_rank, coords.pp_rank, coords.tp_rank)

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
