"""Mixture of experts under expert parallelism, and context parallelism, against one process.

The harness is that of test_llama_layouts.py: the same global batches, seed and steps, and
a single-process reference that takes the whole batch in one forward. The MoE model (a
tiny Llama whose MLPs are 4 SwiGLU experts, top-2, a shared expert, a per-sequence balance
loss with a coefficient large enough to move the gradients) is one function of the batch
under every layout: dropless routing and the per-sequence balance loss do not depend on
micro-batching, data sharding, the sequence split or where the experts live.

All layouts of one model run in one launch of 4 ranks (one process group, one engine
after another), so the whole file costs two launches.
"""

from __future__ import annotations

import pytest
from parallel_harness import SEED, TRAIN, Layout, reference_run, run_ranks
from parallel_workers import resize_and_resume, train_layout_groups

from elastic.models.config import LlamaConfig
from elastic.models.spec import model_spec

pytestmark = pytest.mark.cluster

MOE = LlamaConfig(
    size="tiny",
    moe={"n_experts": 4, "top_k": 2, "shared_expert": True, "expert_hidden": 32, "aux_loss_coef": 1.0},
)
LLAMA = LlamaConfig(size="tiny")
REL = 1e-4

MOE_LAYOUTS = [
    Layout("moe_dp4", dp=4),  # classic DDP, every rank all experts
    Layout("moe_ep2_dp2", dp=2, ep=2),
    Layout("moe_ep2_tp2", dp=1, ep=2, tp=2, micro_batch=2),  # experts' hidden dim split over TP too
    Layout("moe_ep2_pp2", dp=1, ep=2, pp=2, micro_batch=2),
    Layout("moe_zero3_ep2_dp2", dp=2, ep=2, zero=3),  # FSDP x EP: experts sharded over dp
    Layout("moe_zero2_ep4", dp=1, ep=4, zero=2),  # no replica of an expert: experts left out of FSDP
    Layout("moe_ep2_cp2", dp=1, ep=2, cp=2, micro_batch=2),  # balance loss summed over the chunks
    # recompute re-runs the dispatch and combine all-to-alls (and the CP all-gather) in backward
    Layout("moe_zero2_ac_ep2_dp2", dp=2, ep=2, zero=2, ac=True),
    Layout("moe_ac_ep2_cp2", dp=1, ep=2, cp=2, ac=True, micro_batch=2),
]
CP_LAYOUTS = [
    Layout("cp2_dp2", dp=2, cp=2),
    Layout("cp2_tp2", dp=1, cp=2, tp=2, micro_batch=2),
    Layout("cp4", dp=1, cp=4, micro_batch=2),
    Layout("zero3_cp2_dp2", dp=2, cp=2, zero=3),
    Layout("cp2_pp2", dp=1, cp=2, pp=2, micro_batch=2),
]


def _worst(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def _reference(cfg: LlamaConfig) -> tuple[list[float], list[float]]:
    losses, norms = reference_run(model_cfg=cfg)
    assert losses[-1] < losses[0] - 0.1, "the reference must learn, or equal losses prove nothing"
    return losses, norms


@pytest.fixture(scope="module")
def moe_reference() -> tuple[list[float], list[float]]:
    return _reference(MOE)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory) -> list[list[dict]]:
    """The MoE and the CP layouts on one spawn of the 4 ranks: per rank, [moe, cp]."""
    groups = [(MOE_LAYOUTS, MOE, TRAIN), (CP_LAYOUTS, LLAMA, TRAIN)]
    return run_ranks(4, train_layout_groups, (groups,), tmp_path_factory.mktemp("moe-cp"))


@pytest.fixture(scope="module")
def moe_runs(layout_runs) -> list[dict]:
    return [rank[0] for rank in layout_runs]


@pytest.fixture(scope="module")
def cp_runs(layout_runs) -> list[dict]:
    return [rank[1] for rank in layout_runs]


def _check(runs: list[dict], layouts: list[Layout], cfg: LlamaConfig, reference: tuple | None = None) -> None:
    ref_losses, ref_norms = reference or _reference(cfg)
    full = set(dict(model_spec(cfg).build_full(SEED).named_parameters()))
    failures = []
    for layout in layouts:
        for rank, run in enumerate(runs):
            result = run[layout.name]
            worst = _worst(result["losses"], ref_losses), _worst(result["norms"], ref_norms)
            print(f"{layout.name} rank {rank}: losses {worst[0]:.2e}, norms {worst[1]:.2e} (tolerance {REL:g})")
            if max(worst) > REL or max(result["init_diffs"].values()) != 0.0:
                failures.append((layout.name, rank, worst))
            assert result["coords"] == result["expected_coords"]
        held = set().union(*(run[layout.name]["init_diffs"] for run in runs))
        assert held == full, layout.name  # every parameter is held somewhere, by its full-model FQN
    assert not failures, failures


@pytest.mark.timeout(300)
def test_moe_matches_single_process_under_ep_tp_pp_fsdp_cp(moe_runs, moe_reference):
    _check(moe_runs, MOE_LAYOUTS, MOE, moe_reference)


@pytest.mark.timeout(300)
def test_moe_experts_are_sharded_over_ep_and_tp(moe_runs):
    experts = "blocks.0.mlp.experts.w1"
    assert moe_runs[0]["moe_ep2_dp2"]["placements"][experts] == "(Replicate(), Shard(dim=0))"
    assert moe_runs[0]["moe_ep2_tp2"]["placements"][experts] == "(Shard(dim=0), Shard(dim=2))"
    # FSDP over the dp ranks that hold the same experts, on top of the EP shard
    assert moe_runs[0]["moe_zero3_ep2_dp2"]["placements"][experts] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert moe_runs[0]["moe_zero2_ep4"]["placements"][experts] == "(Shard(dim=0),)"
    # dense weights are averaged over dp x ep: one DP unit for the 4 ranks
    assert moe_runs[0]["moe_zero2_ep4"]["placements"]["blocks.0.attn.wq.weight"] == "(Shard(dim=0),)"


@pytest.mark.timeout(300)
def test_llama_cp_matches_single_process(cp_runs):
    _check(cp_runs, CP_LAYOUTS, LLAMA)


@pytest.mark.timeout(300)
def test_moe_checkpoint_reshards_across_ep_and_cp_degrees(tmp_path, moe_reference):
    """EP 2 x CP 2 (DDP) -> DCP checkpoint -> the same 4 processes as EP 4 under ZeRO-2: the
    experts are saved by their full ``[E, ...]`` FQNs, so the resumed run goes on as the
    single process does."""
    before = Layout("moe_ep2_cp2", dp=1, ep=2, cp=2, micro_batch=2)
    after = Layout("moe_zero2_ep4", dp=1, ep=4, zero=2)
    runs = run_ranks(4, resize_and_resume, (before, after, 2, MOE), tmp_path)
    ref_losses, ref_norms = moe_reference
    for run in runs:
        assert run["resumed_at"] == 2
        print(f"resumed: losses {_worst(run['losses'], ref_losses):.2e}, norms {_worst(run['norms'], ref_norms):.2e}")
        assert run["losses"] == pytest.approx(ref_losses, rel=REL)
        assert run["norms"] == pytest.approx(ref_norms, rel=REL)
