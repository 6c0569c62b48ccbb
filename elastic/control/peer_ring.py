"""Two searches of ``recovery_plan.replica_peers``, each in near-linear time (pure, driver side).

* ``ring_shift``: the smallest k (a multiple of the replica size first) such that rank r + k
  is on another node than rank r, for every rank at once. Found from the differences between
  ranks that share a node, which are the only forbidden shifts: O(N x ranks per node), not
  O(N^2).
* ``LeastLoaded``: when no such shift exists, each rank's copy goes to the least-loaded rank
  on another node (in another replica where one exists there), the nearest in ring order
  first. Ranks are kept in buckets by load, each bucket sorted by position, so a pick looks
  at the lowest buckets only and skips at most the ranks of its own node and replica in
  each: O(log N + ranks per node + replica size) per rank.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import Counter
from collections.abc import Sequence

# Above this many ranks on one node, the pairwise differences cost more than scanning the
# shifts one by one (each failing shift is usually refuted within a few ranks).
_PAIRWISE_MAX = 64


def ring_shift(nodes: Sequence[str], prefer_multiples_of: int = 1) -> int | None:
    """The smallest k in 1..n-1 with ``nodes[(r + k) % n] != nodes[r]`` for every r, or None;
    the smallest multiple of ``prefer_multiples_of`` with that property first (a shift by
    whole replicas puts every copy in another replica)."""
    n = len(nodes)
    candidates = [*range(prefer_multiples_of, n, prefer_multiples_of), *range(1, n)]
    positions: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        positions.setdefault(node, []).append(r)
    if max((len(p) for p in positions.values()), default=0) > _PAIRWISE_MAX:
        return _scan_shift(nodes, candidates)
    forbidden: set[int] = set()
    for ranks in positions.values():
        for a in ranks:
            for b in ranks:
                if a != b:
                    forbidden.add((b - a) % n)
    return next((k for k in candidates if k not in forbidden), None)


def _scan_shift(nodes: Sequence[str], candidates: list[int]) -> int | None:
    n = len(nodes)
    return next((k for k in candidates if all(nodes[(r + k) % n] != nodes[r] for r in range(n))), None)


class LeastLoaded:
    """Picks, for rank r, the rank on another node with the fewest copies assigned so far,
    in another replica (``replica_size`` consecutive ranks) where one is on another node,
    the nearest after r in ring order among equals; the pick's load goes up by one."""

    def __init__(self, nodes: Sequence[str], replica_size: int = 1):
        self.nodes, self.size = nodes, replica_size
        self.load = [0] * len(nodes)
        self.buckets: list[list[int]] = [list(range(len(nodes)))]  # load -> positions, sorted
        self.on_node = Counter(nodes)
        self.in_replica = Counter(q // replica_size for q in range(len(nodes)))
        self.in_replica_on_node = Counter((q // replica_size, node) for q, node in enumerate(nodes))

    def pick(self, r: int) -> int:
        home, replica = self.nodes[r], r // self.size
        elsewhere = len(self.nodes) - self.on_node[home]
        mine_elsewhere = self.in_replica[replica] - self.in_replica_on_node[(replica, home)]
        other_replica = elsewhere > mine_elsewhere  # some rank on another node is in another replica
        for bucket in self.buckets:
            start = bisect_right(bucket, r)
            for i in range(len(bucket)):  # ring order from r + 1: skips only r's node (and replica)
                q = bucket[(start + i) % len(bucket)]
                if self.nodes[q] != home and not (other_replica and q // self.size == replica):
                    self._bump(q)
                    return q
        raise ValueError(f"rank {r}: no rank on another node")

    def _bump(self, q: int) -> None:
        level = self.load[q]
        bucket = self.buckets[level]
        del bucket[bisect_right(bucket, q) - 1]
        self.load[q] = level + 1
        if len(self.buckets) == level + 1:
            self.buckets.append([])
        insort(self.buckets[level + 1], q)
