"""The greedy packing behind the rank layout: TP groups, then replicas, then which replicas to use
(pure, no Ray; called by ``planner.py`` on the driver and in the simulator).

At each level (one node, one NVLink domain or rack, anywhere) only what the level below could
not use is pooled, which gives the most whole groups and the fewest that span a level
(``planner.py``'s module docstring, points 1 to 3).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from elastic.placement.layout_plan import TPGroup
from elastic.placement.topology import NVLINK_DOMAIN, NodeInfo

T = TypeVar("T")


def pack(items: list[T], size: int, levels: list[Callable[[T], Hashable | None]]) -> list[tuple[list[T], int]]:
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


def tp_groups(nodes: list[NodeInfo], slots: dict[str, int], tp: int, device: str, cross: bool) -> list[TPGroup]:
    """Every TP group of ``tp`` worker slots that fits, node-local first (module docstring)."""
    by_name = {n.name: n for n in nodes}
    items = [n.name for n in nodes for _ in range(slots[n.name])]
    levels: list[Callable[[str], Hashable | None]] = [lambda name: name]
    if device == "cuda":
        levels.append(lambda name: by_name[name].labels.get(NVLINK_DOMAIN))
    elif cross:
        levels += [lambda name: ("rack", by_name[name].rack), lambda name: "*"]
    position = {name: i for i, name in enumerate(by_name)}
    groups = [tuple(g) for g, _ in pack(items, tp, levels)]
    return sorted(groups, key=lambda g: (position[g[0]], g))


@dataclass(frozen=True)
class Replica:
    groups: tuple[TPGroup, ...]
    level: int  # 0: one node, 1: one rack, 2: spans racks
    index: int
    home_rack: str | None
    cross_rack: bool


def replicas(groups: list[TPGroup], pp: int, racks: dict[str, str | None]) -> list[Replica]:
    """Every replica of ``pp`` TP groups, node-local first, then rack-local, then the leftovers."""

    def one_node(g: TPGroup) -> Hashable | None:
        return g[0] if len(set(g)) == 1 else None

    def one_rack(g: TPGroup) -> Hashable | None:
        rs = {racks[n] for n in g}
        return ("rack", rs.pop()) if len(rs) == 1 else None

    packed = pack(groups, pp, [one_node, one_rack, lambda g: "*"])
    out: list[Replica] = []
    for i, (grps, level) in enumerate(packed):
        nodes = [n for g in grps for n in g]
        out.append(Replica(tuple(grps), level, i, racks[nodes[0]], len({racks[n] for n in nodes}) > 1))
    return out


def choose(replicas: list[Replica], dp: int, racks: dict[str, str | None]) -> list[list[TPGroup]]:
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


def tp_too_big(nodes: list[NodeInfo], slots: dict[str, int], tp: int, device: str, cross: bool) -> str:
    """Why no TP group of ``tp`` fits: the largest node or NVLink domain, for the error."""
    unit = "worker slots"
    if cross:
        return f"tp={tp} needs {tp} {unit} but the whole cluster has {sum(slots.values())}"
    domains: dict[str, int] = {}
    for n in nodes:
        key = n.labels.get(NVLINK_DOMAIN, f"node {n.name}") if device == "cuda" else n.name
        domains[key] = domains.get(key, 0) + slots[n.name]
    best = max(domains, key=lambda key: domains[key])
    where = "NVLink domain" if device == "cuda" else "node"
    return (
        f"tp={tp} is larger than any {where}'s {unit} (largest: {domains[best]} on {best}); "
        f"TP groups must stay inside one {where}"
    )
