"""The memory model against measurement: predicted and measured per-rank peaks agree within
+-15% for every layout of ``benchmarks/parallel_layouts.py`` (same code, same model, same
batch: ``elastic/testing/layout_memory.py``), in fp32 and in bf16, and the sweep keeps a
tensor-parallel layout whose measured peak fits its budget.

The measured peak is the live-tensor tracker's (a CPU stand-in for
``torch.cuda.max_memory_allocated``; deterministic: it counts tensor bytes, not time).
bf16 on CPU runs the engine's CUDA code paths (autocast with ZeRO 0, FSDP2's bf16 policy
with ZeRO >= 1) with CPU kernels: what they store is what the CUDA kernels store, except
the attention output's layout (docs/sweep.md).
"""

from __future__ import annotations

import dataclasses

import pytest

from elastic.models.config import LlamaConfig
from elastic.models.gpt import ModelConfig
from elastic.testing.layout_memory import (
    DEFAULT_MICRO_BATCH,
    DEFAULT_MODEL,
    LAYOUTS,
    Layout,
    peak_vs_prediction,
    run_layouts,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

TOLERANCE = 0.15


def _check(layouts, per_rank, model, micro_batch, dtype="fp32") -> None:
    ratios = {}
    for layout in layouts:
        measured, est, ratio = peak_vs_prediction(layout, per_rank, model, micro_batch, dtype=dtype)
        ratios[layout.name] = ratio
        print(
            f"{layout.name:<19} {dtype} measured {measured / 2**20:7.2f} MiB  predicted {est.total / 2**20:7.2f} MiB  "
            f"measured/predicted {ratio:.3f}"
        )
    off = {name: round(r, 3) for name, r in ratios.items() if abs(r - 1) > TOLERANCE}
    assert not off, f"measured/predicted peak outside 1 +- {TOLERANCE}: {off} (all: {ratios})"


def test_predicted_peak_within_15_percent_for_every_benchmark_layout():
    per_rank = run_layouts(LAYOUTS, DEFAULT_MODEL, world=4)
    _check(LAYOUTS, per_rank, DEFAULT_MODEL, DEFAULT_MICRO_BATCH)


BF16_LLAMA = LlamaConfig(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, vocab_size=512, seq_len=64, multiple_of=32)
BF16_LAYOUTS = [
    Layout("DP4+AC", dp=4, ac=True),  # autocast, classic DDP, recompute
    Layout("DP2xTP2", dp=2, tp=2),  # autocast, replicate, TP with a loss-parallel head
    Layout("TP2xPP2", dp=1, tp=2, pp=2),  # autocast, 8 micro-batches through 2 stages
    Layout("ZeRO-1xDP4", dp=4, zero=1),  # FSDP2's bf16 parameters, fp32 unsharded gradients
]


def test_bf16_layouts_within_15_percent():
    per_rank = run_layouts(BF16_LAYOUTS, BF16_LLAMA, world=4, dtype="bf16")
    _check(BF16_LAYOUTS, per_rank, BF16_LLAMA, DEFAULT_MICRO_BATCH, dtype="bf16")


def test_sweep_keeps_a_tp_layout_whose_measured_peak_fits():
    """A large vocabulary on a small model (the Ultra-Scale Playbook's TP8 case in miniature):
    the head is vocab-parallel, so the logits are split by TP. The old model counted them
    whole and would have pruned this layout at a budget 10% above its measured peak."""
    from elastic.tune.space import Cluster, enumerate_space
    from jobs import JobSpec

    model = ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=8192, seq_len=64)
    layout = Layout("TP2", dp=1, tp=2)
    per_rank = run_layouts([layout], model, world=2, global_batch=8, micro_batch=4)
    measured, est, ratio = peak_vs_prediction(layout, per_rank, model, 4)
    assert abs(ratio - 1) <= TOLERANCE, ratio
    spec = JobSpec.from_dict(
        {
            "model": model.model_dump(),
            "parallel": {"tp": 2, "micro_batch": 4},
            "elastic": {"min_dp": 1, "max_dp": 1},
            "train": {"global_batch": 8},
        }
    )
    budget = 1.10 * measured
    (cand,) = enumerate_space(spec, {"tp": [2]}, Cluster(2, 2, budget))
    assert cand.status == "feasible", cand.reason
    assert cand.predicted_mem_bytes == est.total
    # The old rule (the logits and the embedding counted whole under TP) prunes it.
    from elastic.parallel.memory_model import estimate_memory

    m, table = model.memory_inputs(), 8192 * 64
    whole = dataclasses.replace(
        m,
        vocab_parallel=False,
        first_split=0,
        last_split=0,
        first_whole=m.first_whole + table,
        last_whole=m.last_whole + table,
    )
    assert estimate_memory(whole, tp=2, micro_batch=4, num_microbatches=2).total > budget


def test_single_rank_engine_keeps_what_the_model_counts():
    """One rank, a vocabulary large enough that the loss is the peak: the engine's probed
    step within 5% of the prediction, in fp32 and bf16 autocast. The engine drops the logits
    before backward; holding them would add a third to the loss's terms."""
    import torch

    from elastic.engine import TrainEngine
    from elastic.optim import TrainConfig
    from elastic.parallel.memory_model import estimate_memory
    from elastic.testing.single_rank import SingleRank
    from elastic.tune.trial import ProbedParallel

    model = LlamaConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=8192, seq_len=64, multiple_of=32)
    rank = SingleRank("cpu")
    dims = rank.join()
    try:
        for dtype in ("fp32", "bf16"):
            parallel = ProbedParallel(micro_batch=4, memory_probe_step=2)
            train = TrainConfig(steps=10, global_batch=4, warmup_steps=1, dtype=dtype)
            engine = TrainEngine(model, parallel, train, dims, seed=0, device="cpu")
            gen = torch.Generator().manual_seed(0)
            for _ in range(2):
                tokens = torch.randint(0, model.vocab_size, (4, model.seq_len + 1), generator=gen)
                engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
                engine.optimizer_step()
            est = estimate_memory(
                model, micro_batch=4, num_microbatches=1, compute_dtype_bytes=2 if dtype == "bf16" else None
            )
            ratio = engine.peak_mem_bytes() / est.total
            print(f"{dtype}: probed {engine.peak_mem_bytes()} predicted {est.total} ratio {ratio:.3f}")
            assert abs(ratio - 1) <= 0.05, (dtype, ratio)
            del engine
    finally:
        rank.close()
