"""Pure planning of what a re-formation keeps (``elastic/control/regroup.py``), without Ray:
which ranks keep their state and their TP/PP groups, when a shrink is possible, and where
HSDP's survivors go."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from elastic.control import recovery_plan as plan
from elastic.control.regroup import arrange_shard_groups, hsdp_order, regroup

pytestmark = pytest.mark.timeout(30)


@dataclass(eq=False)
class M:
    rank: int
    node_id: str


def test_ddp_survivors_keep_their_state_and_their_tp_groups():
    # dp 3 x tp 2, replica 1 (old ranks 2, 3) lost: survivors 0, 1, 4, 5 become 0..3.
    out = regroup([0, 1, 4, 5], 3, 2, tp=2, pp=1, zero=0)
    assert [r.keep_state for r in out] == [True] * 4
    assert [r.unchanged_groups for r in out] == [("tp",)] * 4
    assert [r.prior_rank for r in out] == [0, 1, 4, 5]
    assert out[0].shrink_excluded == (2, 3)


def test_ep_and_cp_layouts_keep_nothing_yet_but_say_who_was_who():
    # dp 3 x ep 2 (replicas of 2 ranks), replica 1 (old ranks 2, 3) lost. Under DDP an EP
    # rank's experts would match, but the worker keeps no EP/CP state: every rank restores.
    for ep, cp in ((2, 1), (1, 2)):
        out = regroup([0, 1, 4, 5], 3, 2, tp=1, pp=1, zero=0, ep=ep, cp=cp)
        assert [r.keep_state for r in out] == [False] * 4
        assert [r.unchanged_groups for r in out] == [()] * 4
        assert [r.prior_rank for r in out] == [0, 1, 4, 5]
        assert out[0].shrink_excluded == (2, 3)  # the old world is dp x ep x cp = 6 ranks


def test_a_split_tp_group_is_not_unchanged():
    # tp 2 x pp 2, dp 2: the new replica 0 takes old ranks 0, 1 as its stage 0 but old 6, 7
    # as its stage 1: the TP groups stay, the PP groups do not.
    out = regroup([0, 1, 6, 7], 2, 1, tp=2, pp=2, zero=0)
    assert [r.unchanged_groups for r in out] == [("tp",)] * 4
    assert out[0].shrink_excluded == (2, 3, 4, 5)  # the old order less those ranks
    reordered = regroup([4, 5, 6, 7, 0, 1, 2, 3], 2, 2, tp=2, pp=2, zero=0)  # replicas swapped (racks)
    assert all(r.keep_state for r in reordered) and reordered[0].shrink_excluded is None
    kept = regroup([4, 5, 6, 7], 2, 1, tp=2, pp=2, zero=0)
    assert [r.unchanged_groups for r in kept] == [("tp", "pp")] * 4
    assert kept[0].shrink_excluded == (0, 1, 2, 3)


def test_fsdp_shards_move_when_dp_changes():
    out = regroup([0, 1, 3], 4, 3, tp=1, pp=1, zero=3)
    assert [r.keep_state for r in out] == [False, False, False]
    same = regroup([0, 1, 2, 3], 4, 4, tp=1, pp=1, zero=3)  # the same layout again (a newcomer elsewhere)
    assert all(r.keep_state for r in same)


def test_hsdp_survivors_at_their_place_keep_their_shard():
    # dp 4 in shard groups of 2: old DP ranks 0, 1 | 2, 3; DP rank 1 lost, group (2, 3) kept whole.
    out = regroup([2, 3], 4, 2, tp=1, pp=1, zero=3, shard_group=2)
    assert [r.keep_state for r in out] == [True, True]
    swapped = regroup([3, 2], 4, 2, tp=1, pp=1, zero=3, shard_group=2)
    assert [r.keep_state for r in swapped] == [False, False]
    mixed = regroup([0, 3], 4, 2, tp=1, pp=1, zero=3, shard_group=2)  # places 0 and 1 of two old groups
    assert [r.keep_state for r in mixed] == [True, True]


def test_newcomers_keep_nothing_and_rule_out_a_shrink():
    out = regroup([0, 1, None, None], 2, 2, tp=2, pp=1, zero=0)
    assert [r.keep_state for r in out] == [True, True, False, False]
    assert out[2].prior_rank is None and out[2].unchanged_groups == ()
    assert all(r.shrink_excluded is None for r in out)


def _replicas(ranks: list[int], size: int = 1) -> list[list[M]]:
    return [[M(r * size + i, f"n{r}") for i in range(size)] for r in ranks]


def test_hsdp_order_keeps_complete_groups_first_and_spreads_places():
    # shard groups of 2 over old DP ranks (0, 1), (2, 3), (4, 5); DP rank 1 was lost.
    order = hsdp_order(_replicas([0, 2, 3, 4, 5]), lambda m: m.rank, 2, 1)
    assert [r[0].rank for r in order] == [2, 3, 4, 5, 0]
    # only places 0 survive in two groups, place 1 in one: places alternate while they last
    order = hsdp_order(_replicas([0, 2, 5]), lambda m: m.rank, 2, 1)
    assert [r[0].rank for r in order] == [0, 5, 2]


def test_arrange_puts_survivors_at_their_place_and_newcomers_in_gaps():
    reps = _replicas([2, 4], 2) + [[M(-1, "new"), M(-1, "new")]] + _replicas([7], 2)
    # tp 2: old DP ranks 2 (place 0), 4 (place 0), a newcomer, 7 (place 1); groups of 2
    members = arrange_shard_groups(reps, lambda m: m.rank, 2, 2)
    dp_of = [m.rank // 2 if m.rank >= 0 else None for m in members[::2]]
    assert dp_of == [2, 7, 4, None]


def test_plan_reform_keeps_hsdp_groups_whole_and_reports_what_ranks_keep():
    racks = {"a": "r1", "b": "r1", "c": "r0", "d": "r0"}
    # old dp 4 (groups of 2): DP ranks 0 (a), 1 (b) | 2 (c), 3 (d); new layout dp 2 from 0 and 3
    members = [M(0, "a"), M(3, "d")]
    p = plan.plan_reform(
        members, 2, 5, plan.RestoreChoice(5, "memory"), [], tp=1, pp=1, zero=3, replicate=False,
        rack_of=racks.get, shard_group=2, old_dp=4,
    )  # fmt: skip
    assert [m.rank for m in p.members] == [0, 3]  # one group, each at its place
    assert [r.keep_state for r in p.regroup] == [True, True]
    ddp = plan.plan_reform(
        [M(0, "a"), M(2, "c")], 2, 5, plan.RestoreChoice(5, "memory"), [], tp=1, pp=1, zero=0, replicate=False,
        rack_of=racks.get, old_dp=3,
    )  # fmt: skip
    assert [m.node_id for m in ddp.members] == ["c", "a"]  # rack r0 first
    assert [r.keep_state for r in ddp.regroup] == [True, True] and ddp.regroup[0].shrink_excluded is None


@pytest.mark.parametrize(
    "zero,shard_group,holdings,want",
    [
        # HSDP, dp 4 in groups of 2: one copy of each place suffices (here: old ranks 2 and 1).
        (3, 2, [{2: [7]}, {1: [7]}], 7),
        (3, 2, [{0: [7]}, {2: [7]}], None),  # place 1 missing
        (3, None, [{2: [7]}, {1: [7]}], None),  # plain FSDP needs every shard
    ],
)
def test_hsdp_snapshots_cover_with_one_copy_of_each_place(zero, shard_group, holdings, want):
    assert plan.covering_step(holdings, 4, 1, 1, zero, shard_group=shard_group) == want


def test_free_survivors_on_nccl_kills_the_lost_replica_and_shrinks_the_others():
    """NCCL (``shrink_unit``, the replica size): the culprit's whole replica goes, and every
    other live member is asked to shrink the group without it at once (aborting the
    collectives it is blocked in); on gloo nothing is shrunk: the others abort their step and
    cut their links to every rank of the generation that is gone."""
    from fake_group import FakeMember, FakeWorkerGroup

    from elastic.control.reform import free_survivors

    group = FakeWorkerGroup(spec=None, corpus_uri="")
    group.members = [FakeMember(r, f"pg{r // 2}", f"n{r // 2}") for r in range(6)]  # tp 2: replicas of 2
    survivors, _ = free_survivors(group, [group.members[3]], 10.0, shrink_unit=2)
    assert [m.rank for m in survivors] == [0, 1, 4, 5]
    assert ("kill", [2, 3]) in group.calls
    assert ("shrink", [0, 1, 4, 5], [2, 3]) in group.calls
    gloo = FakeWorkerGroup(spec=None, corpus_uri="")
    gloo.members = [FakeMember(r, f"pg{r // 2}", f"n{r // 2}") for r in range(6)]
    gloo.members[5].dead = True  # lost earlier in this generation: its links are cut too
    free_survivors(gloo, [gloo.members[3]], 10.0)
    assert not [c for c in gloo.calls if c[0] == "shrink"] and ("kill", [3]) in gloo.calls
    # gloo: the others leave the step, and cut their links to the lost ranks
    assert ("abort_steps", [0, 1, 2, 4], [3, 5]) in gloo.calls


def test_free_survivors_drops_a_survivor_that_died_while_it_was_waited_for():
    """A survivor that left the job during the wait (a second failure, or one that exited while
    blocked in a collective after the abort: ``report_if_stuck``) is not handed on as a
    survivor: the re-formation would configure a dead actor and fail again."""
    from fake_group import FakeMember, FakeWorkerGroup

    from elastic.control.reform import free_survivors

    class DiesWhileWaited(FakeWorkerGroup):
        def wait_runs(self, members, timeout):
            self.members[2].dead = True  # the lost rank's partner left the job meanwhile
            return []

    group = DiesWhileWaited(spec=None, corpus_uri="")
    group.members = [FakeMember(r, f"pg{r}", f"n{r}") for r in range(4)]
    survivors, boundary = free_survivors(group, [group.members[3]], 10.0)
    assert [m.rank for m in survivors] == [0, 1] and boundary.stuck == []
