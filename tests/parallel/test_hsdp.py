"""HSDP (``parallel.shard_group``) against the single-process reference, and DCP resharding
between HSDP and the other layouts.

FSDP shards inside groups of ``shard_group`` DP ranks and replicates across the groups; the
loss and pre-clip gradient norm of every step must match the reference within 1e-4
relative (the reduction order differs: a reduce-scatter in the group, then an all-reduce
across groups), and the parameters must be held as ``(Replicate(), Shard(0))`` on the 2-D
(replicate, shard) mesh.
"""

from __future__ import annotations

import pytest
from parallel_harness import Layout, reference_run, run_ranks
from parallel_workers import resize_and_resume, train_layouts
from test_parallel_engine import assert_close

pytestmark = pytest.mark.cluster

LAYOUTS = [
    Layout("hsdp_z3_dp4_g2", dp=4, zero=3, shard_group=2),
    Layout("hsdp_z1_dp4_g2", dp=4, zero=1, shard_group=2),
    Layout("hsdp_z2_dp2_tp2_g1", dp=2, tp=2, zero=2, micro_batch=2, shard_group=1),
]
IDS = [layout.name for layout in LAYOUTS]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float]]:
    return reference_run()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(4, train_layouts, (LAYOUTS,), tmp_path_factory.mktemp("hsdp"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_hsdp_matches_single_process(layout, runs, reference):
    ref_losses, ref_norms = reference
    per_rank = [run[layout.name] for run in runs]
    for rank, result in enumerate(per_rank):
        assert_close(result["losses"], ref_losses, f"{layout.name} rank {rank} losses")
        assert_close(result["norms"], ref_norms, f"{layout.name} rank {rank} grad norms")
        assert max(result["init_diffs"].values()) == 0.0
        assert result["coords"] == result["expected_coords"]
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)


@pytest.mark.timeout(240)
def test_hsdp_shards_inside_groups_and_replicates_across(runs):
    wq = "blocks.0.attn.wq.weight"
    for run in runs:
        assert run["hsdp_z3_dp4_g2"]["placements"][wq] == "(Replicate(), Shard(dim=0))"
        held = run["hsdp_z2_dp2_tp2_g1"]["placements"][wq]  # (replicate, shard of the tp shard, tp)
        assert held == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("before", "after"),
    [
        (Layout("hsdp_z3_dp4_g2", dp=4, zero=3, shard_group=2), Layout("zero3_dp2", dp=2, zero=3, micro_batch=4)),
        (Layout("zero1_dp4", dp=4, zero=1), Layout("hsdp_z2_dp2_g1", dp=2, zero=2, micro_batch=4, shard_group=1)),
    ],
    ids=["hsdp_to_fsdp", "fsdp_to_hsdp"],
)
def test_checkpoint_reshards_between_hsdp_and_fsdp(tmp_path, reference, before, after):
    """DCP checkpoint at step 2 under one layout, resumed at world 2 under the other: the
    whole curve is the reference's."""
    runs = run_ranks(4, resize_and_resume, (before, after, 2), tmp_path)
    ref_losses, ref_norms = reference
    for rank, run in enumerate(runs[:2]):
        assert run["resumed_at"] == 2
        assert_close(run["losses"], ref_losses, f"{before.name}->{after.name} rank {rank} losses")
        assert_close(run["norms"], ref_norms, f"{before.name}->{after.name} rank {rank} grad norms")
