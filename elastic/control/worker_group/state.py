"""The worker group's members and the indexes it finds them by (driver side): by worker id
(how agents name them), by node, and the *notable* ones (with news since the last layout),
so a look costs O(news), not O(ranks)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from elastic.control.worker_group.worker import Member


class GroupState:
    def __init__(self) -> None:
        self.members: list[Member] = []  # ordered by rank
        self.by_wid: dict[int, Member] = {}
        self.notable: set[int] = set()  # worker ids with news
        self._on_node: dict[str, list[Member]] = {}  # node -> every member spawned there
        self._wids = itertools.count()

    def number(self, members: Iterable[Member]) -> None:
        """Give new members their worker ids."""
        for m in members:
            m.wid = next(self._wids)
            self.by_wid[m.wid] = m
            self._on_node.setdefault(m.node_id, []).append(m)

    def on_node(self, node: str) -> list[Member]:
        """Its members, live or not (newcomers not configured yet included)."""
        return self._on_node.get(node, [])

    def notable_members(self) -> list[Member]:
        return [self.by_wid[w] for w in self.notable if w in self.by_wid]

    def form(self, members: Sequence[Member]) -> None:
        """``members`` become ranks 0..n-1 of a new layout; only the dead stay notable."""
        for rank, m in enumerate(members):
            m.rank, m.run_result, m.silent_s, m.launched, m.quiet = rank, None, 0.0, False, False
        self.members = list(members)
        self.notable = {w for w in self.notable if self.by_wid[w].dead}


def by_node(members: Iterable[Member]) -> dict[str, list[Member]]:
    out: dict[str, list[Member]] = {}
    for m in members:
        out.setdefault(m.node_id, []).append(m)
    return out


def wids_by_node(members: Sequence[Member]) -> dict[str, set[int]]:
    return {node: {m.wid for m in ms} for node, ms in by_node(members).items()}
