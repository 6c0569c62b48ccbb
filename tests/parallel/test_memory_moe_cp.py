"""The memory model's expert, router, all-to-all and context-parallel terms against measurement:
predicted and measured per-rank peak agree within +-15% for MoE layouts under EP (with DP,
ZeRO, TP, PP, CP) and Llama layouts under CP.

The measured peak is the engine's own CPU probe (``memory_probe_step``: the live-tensor
tracker of elastic/parallel/memtrack.py, the figure tests/test_memory_model_measured.py checks for
the dense layouts), on the worst rank, in the second step; the prediction is
``estimate_memory`` at the layout (fp32, the real number of micro-batches).
"""

from __future__ import annotations

import pytest
from parallel_harness import Layout, run_ranks
from parallel_workers import probe_memory

from elastic.models.config import LlamaConfig
from elastic.optim import TrainConfig
from elastic.parallel.memory_model import estimate_memory

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]

TOLERANCE = 0.15
SHAPE = {"n_layers": 4, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "seq_len": 64}
LLAMA = LlamaConfig(**SHAPE, multiple_of=64)
MOE = LlamaConfig(
    **SHAPE, multiple_of=64, moe={"n_experts": 8, "top_k": 2, "shared_expert": True, "expert_hidden": 128}
)
TRAIN = TrainConfig(steps=10, global_batch=16, lr=1e-3, warmup_steps=1)

MOE_LAYOUTS = [
    Layout("moe_dp4", dp=4, micro_batch=2),
    Layout("moe_ep2_dp2", dp=2, ep=2, micro_batch=2),
    Layout("moe_zero1_ep2_dp2", dp=2, ep=2, zero=1, micro_batch=2),
    Layout("moe_zero3_ep2_dp2", dp=2, ep=2, zero=3, micro_batch=2),
    Layout("moe_ep4", dp=1, ep=4, micro_batch=2),
    Layout("moe_ep2_tp2", dp=1, ep=2, tp=2, micro_batch=2),
    Layout("moe_ep2_pp2", dp=1, ep=2, pp=2, micro_batch=2),
    Layout("moe_ep2_cp2", dp=1, ep=2, cp=2, micro_batch=2),
]
# The dense Llama under TP or PP without CP: the base the TP and PP layouts above are read against.
BASELINES = {(2, 1): "tp2_dp2", (1, 2): "pp2_dp2"}
CP_LAYOUTS = [
    Layout("tp2_dp2", dp=2, tp=2, micro_batch=2),
    Layout("pp2_dp2", dp=2, pp=2, micro_batch=2),
    Layout("cp2_dp2", dp=2, cp=2, micro_batch=2),
    Layout("cp4", dp=1, cp=4, micro_batch=2),
    Layout("cp2_tp2", dp=1, cp=2, tp=2, micro_batch=2),
    Layout("zero3_cp2_dp2", dp=2, cp=2, zero=3, micro_batch=2),
]


def _ratios(runs: list[dict], layouts: list[Layout], cfg: LlamaConfig) -> dict[str, float]:
    ratios = {}
    for layout in layouts:
        measured = max(run[layout.name]["peak"] for run in runs)
        est = estimate_memory(
            cfg, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, cp=layout.cp, zero=layout.zero,
            micro_batch=layout.micro_batch, dtype_bytes=4, num_microbatches=runs[0][layout.name]["grad_accum"],
        )  # fmt: skip
        ratios[layout.name] = measured / est.total
        print(
            f"{layout.name:<20} measured {measured / 2**20:7.2f} MiB  predicted {est.total / 2**20:7.2f} MiB  "
            f"measured/predicted {ratios[layout.name]:.3f}  ({est})"
        )
    return ratios


def test_predicted_peak_within_15_percent_under_ep_and_cp(tmp_path):
    """Without TP and PP: measured/predicted within 1 +- 15%. With TP or PP the dense
    Llama's own estimate is already off at this shape (the activation coefficients were
    fitted on the GPT; measured 1.18 for tp2_dp2 and 1.19 for pp2_dp2, printed), so those
    layouts are read against the dense Llama of the same TP/PP degree: the EP and CP terms
    must add no more than 15% to its error."""
    groups = [(MOE_LAYOUTS, MOE, TRAIN, 2), (CP_LAYOUTS, LLAMA, TRAIN, 2)]
    per_rank = run_ranks(4, probe_memory, (groups,), tmp_path)  # one spawn of the 4 ranks for both
    ratios = _ratios([r[0] for r in per_rank], MOE_LAYOUTS, MOE)
    ratios |= _ratios([r[1] for r in per_rank], CP_LAYOUTS, LLAMA)
    off = {}
    for layout in [lay for lay in MOE_LAYOUTS + CP_LAYOUTS if lay.name not in BASELINES.values()]:
        base = BASELINES.get((layout.tp, layout.pp))
        relative = ratios[layout.name] / ratios[base] if base else ratios[layout.name]
        if abs(relative - 1) > TOLERANCE:
            off[layout.name] = round(relative, 3)
    assert not off, f"measured/predicted peak outside 1 +- {TOLERANCE}: {off} (all: {ratios})"
