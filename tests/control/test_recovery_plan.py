"""Pure recovery planning, without Ray: whole replicas, rank order, snapshot coverage."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from elastic.control import recovery_plan as plan

pytestmark = pytest.mark.timeout(30)


@dataclass(eq=False)
class M:
    rank: int
    node_id: str


def test_complete_replicas_drops_broken_ones():
    # replica size 2 (tp=2): ranks 0-1, 2-3, 4-5; rank 3 is lost.
    members = [M(r, f"n{r // 2}") for r in (5, 0, 2, 1, 4)]
    whole = plan.complete_replicas(members, 2)
    assert [[m.rank for m in r] for r in whole] == [[0, 1], [4, 5]]


def test_rank_order_is_rack_by_rack_and_keeps_replica_order():
    racks = {"a": "r1", "b": "r0", "c": "r1", "d": "r0"}
    members = [M(i % 2, n) for i, n in enumerate("aabbccdd")]
    ordered = plan.rank_order(members, 2, racks.get)
    assert [m.node_id for m in ordered] == list("bbddaacc")
    assert [m.rank for m in ordered] == [0, 1] * 4


@pytest.mark.parametrize(
    "zero,holdings,want",
    [
        # DDP, dp=2, tp=2: one copy of each tp shard suffices.
        (0, [{0: [4, 5], 1: [4, 5]}, None], 5),
        (0, [{0: [4, 5]}, {3: [4]}], 4),
        # FSDP: every rank's shard is needed.
        (1, [{0: [5], 1: [5], 2: [5]}, {3: [4]}], None),
        (1, [{0: [4, 5], 1: [4, 5]}, {2: [4, 5], 3: [4]}], 4),
    ],
)
def test_covering_step(zero, holdings, want):
    assert plan.covering_step(holdings, world=4, tp=2, pp=1, zero=zero) == want


def test_owners_for_prefers_own_snapshot_under_ddp():
    a, b = M(0, "n0"), M(2, "n1")
    holders = {0: a, 1: a, 2: b, 3: b}
    # new rank 0 (tp coordinate 0) is served by itself (old rank 0 on member a)
    assert plan.owners_for(0, holders, a, tp=2, pp=1, zero=0) == {0: None}
    # a newcomer with tp coordinate 1 reads one copy from whoever holds it
    c = M(3, "n2")
    assert plan.owners_for(3, holders, c, tp=2, pp=1, zero=0) == {1: a}
    # under FSDP every DP shard of the coordinate is read
    assert plan.owners_for(0, holders, a, tp=2, pp=1, zero=1) == {0: None, 2: b}


def test_holders_at_prefers_the_owner():
    a, b = M(0, "n0"), M(1, "n1")
    held = plan.holders_at([(a, {0: [3], 1: [3]}), (b, {1: [3]})], 3)
    assert held == {0: a, 1: b}


@pytest.mark.parametrize(
    "whole,spare,allowed,want",
    [
        (3, 0, [1, 2, 4], (2, 2, 0)),  # 3 replicas left, dp 3 not allowed: drop one
        (1, 2, [1, 2, 3], (3, 1, 2)),  # grow into spare capacity
        (0, 0, [1, 2], None),
    ],
)
def test_plan_recovery(whole, spare, allowed, want):
    p = plan.plan_recovery(whole, spare, allowed)
    assert (None if p is None else (p.dp, p.keep, p.grow)) == want
