"""Multi-rank gloo tests of ``TrainEngine`` against a single-process reference.

Every layout runs the same seed on the same global batches; its per-step loss (the global
mean, read on every rank) and pre-clip gradient norm must match the reference within
1e-4 relative (``REL``): the reference takes the whole batch in one forward, the layouts
in micro-batches, sharded and reduced over ranks, so the reduction order differs; the
largest difference measured over all layouts is printed. The norm matters: Adam is nearly
invariant to a constant gradient scale, so a wrongly scaled gradient would hardly move the
losses but shows in the norm.

All world-4 layouts share one spawn (one process group, a fresh mesh per layout) to keep
the suite fast on 2 cores.
"""

from __future__ import annotations

import pytest
from parallel_harness import MODEL, SEED, TRAIN, Layout, reference_run, run_ranks
from parallel_workers import resize_and_resume, train_layouts

from elastic.models.gpt import build_model, flops_per_token

pytestmark = pytest.mark.cluster

LAYOUTS = [
    Layout("dp4", dp=4),
    Layout("dp2_tp2", dp=2, tp=2, micro_batch=2),
    Layout("dp2_pp2", dp=2, pp=2, micro_batch=2),
    Layout("tp2_pp2", dp=1, tp=2, pp=2, micro_batch=2),
    Layout("zero3_dp4", dp=4, zero=3),
    Layout("zero2_ac_dp2_tp2", dp=2, tp=2, zero=2, ac=True, micro_batch=2),
    Layout("zero1_dp4", dp=4, zero=1),
    Layout("zero3_ac_dp2_pp2_gpipe", dp=2, pp=2, zero=3, ac=True, micro_batch=2, schedule="gpipe"),
    Layout("pp4_few_microbatches", dp=1, pp=4, micro_batch=4),  # m=2 < pp: 1F1B falls back
]
IDS = [layout.name for layout in LAYOUTS]

REL = 1e-4


def assert_close(got: list[float], want: list[float], what: str) -> None:
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    print(f"{what}: max relative difference {worst:.2e} (tolerance {REL:g})")
    assert got == pytest.approx(want, rel=REL), what


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float]]:
    losses, norms = reference_run()
    assert losses[-1] < losses[0] - 0.1, "the reference must learn, or equal losses prove nothing"
    return losses, norms


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(4, train_layouts, (LAYOUTS,), tmp_path_factory.mktemp("layouts"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_loss_and_grad_norm_match_single_process(layout, runs, reference):
    ref_losses, ref_norms = reference
    per_rank = [run[layout.name] for run in runs]
    for rank, result in enumerate(per_rank):
        assert_close(result["losses"], ref_losses, f"{layout.name} rank {rank} losses")
        assert_close(result["norms"], ref_norms, f"{layout.name} rank {rank} grad norms")
    # The engine reports one global value: bit-identical on every rank.
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
    assert all(r["norms"] == per_rank[0]["norms"] for r in per_rank)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_same_initial_weights_under_every_layout(layout, runs):
    expected = set(dict(build_model(MODEL, SEED).named_parameters()))
    held: set[str] = set()
    for run in runs:
        diffs = run[layout.name]["init_diffs"]
        assert max(diffs.values()) == 0.0
        held |= set(diffs)
    assert held == expected


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_mesh_coordinates_follow_rank_order(layout, runs):
    for rank, run in enumerate(runs):
        coords = run[layout.name]["coords"]
        assert coords == run[layout.name]["expected_coords"]
        dp_rank, pp_rank, tp_rank = coords
        assert rank == ((dp_rank * layout.pp) + pp_rank) * layout.tp + tp_rank


@pytest.mark.timeout(240)
def test_parameters_are_held_as_the_layout_says(runs):
    rank0 = {name: run["placements"] for name, run in runs[0].items()}
    wq, emb, ln = "blocks.0.attn.wq.weight", "tok_emb.weight", "blocks.0.ln1.weight"
    assert rank0["dp4"][wq] == "tensor"  # classic DDP: replicated plain tensors
    assert rank0["zero3_dp4"][wq] == "(Shard(dim=0),)"
    assert rank0["dp2_tp2"][wq] == "(Replicate(), Shard(dim=0))"  # replicate over dp, colwise tp
    assert rank0["dp2_tp2"]["blocks.0.attn.wo.weight"] == "(Replicate(), Shard(dim=1))"  # rowwise
    assert rank0["dp2_tp2"][emb] == "(Replicate(), Shard(dim=0))"  # vocab-parallel embedding
    assert rank0["zero2_ac_dp2_tp2"][ln] == "(Shard(dim=0),)"
    assert "Shard(dim=0)" in rank0["zero2_ac_dp2_tp2"][wq] and rank0["zero2_ac_dp2_tp2"][wq].count(",") == 2
    assert "head.weight" not in rank0["dp2_pp2"]  # the head lives on the last stage only
    assert "head.weight" in runs[1]["dp2_pp2"]["placements"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_recompute_reruns_each_block_forward(layout, runs):
    for run in runs:
        assert run[layout.name]["mlp_forwards_per_micro_batch"] == (2 if layout.ac else 1)


@pytest.mark.timeout(240)
def test_reported_cost_figures(runs):
    tokens = TRAIN.global_batch * MODEL.seq_len
    for run in runs:
        assert run["dp4"]["flops_per_step"] == pytest.approx(flops_per_token(MODEL) * tokens)
        assert run["dp4"]["peak_mem_bytes"] > 0


@pytest.mark.timeout(240)
def test_pipeline_schedule_and_bubble(runs):
    run = runs[0]
    assert run["tp2_pp2"]["schedule"] == "Schedule1F1B"
    assert run["tp2_pp2"]["bubble"] == pytest.approx((2 - 1) / 4)
    assert run["zero3_ac_dp2_pp2_gpipe"]["schedule"] == "ScheduleGPipe"
    assert run["pp4_few_microbatches"]["schedule"] == "ScheduleGPipe"
    assert run["pp4_few_microbatches"]["bubble"] == pytest.approx(3 / 2)
    assert run["dp4"]["schedule"] is None and run["dp4"]["bubble"] == 0.0


@pytest.mark.timeout(240)
def test_resize_rebuilds_in_process_and_resumes(tmp_path, reference):
    """World 4 (ZeRO-3, DP2 x TP2) -> checkpoint -> destroy the group -> world 2 (PP2).

    Ranks 0 and 1 re-initialise the process group at the new size in the same processes,
    build a new engine, load the resharded checkpoint and keep training; the whole loss
    curve must be the reference's.
    """
    before = Layout("zero3_dp2_tp2", dp=2, tp=2, zero=3, micro_batch=2)
    after = Layout("pp2", dp=1, pp=2, micro_batch=4)
    runs = run_ranks(4, resize_and_resume, (before, after, 2), tmp_path)
    ref_losses, ref_norms = reference
    for rank, run in enumerate(runs[:2]):
        assert run["resumed_at"] == 2
        assert_close(run["losses"], ref_losses, f"resized rank {rank} losses")
        assert_close(run["norms"], ref_norms, f"resized rank {rank} grad norms")
    for rank, run in enumerate(runs[2:], start=2):
        assert_close(run["losses"], ref_losses[:2], f"rank {rank} losses before it left")


@pytest.mark.timeout(240)
def test_cached_state_dict_tracks_the_live_state(runs):
    """Snapshots reuse one DCP state dict per engine; after more steps it must still equal a
    fresh ``get_state_dict`` (weights, optimizer moments and the scheduled LR)."""
    for layout in LAYOUTS:
        for rank, run in enumerate(runs):
            assert run[layout.name]["state_dict_cache_ok"], (layout.name, rank)
    cached = {layout.name for layout in LAYOUTS if all(run[layout.name]["state_dict_cached"] for run in runs)}
    assert {"dp4", "zero3_dp4", "zero1_dp4", "dp2_tp2"} <= cached, cached
