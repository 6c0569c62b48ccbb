"""The analytical memory model against hand-computed answers for small configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic.errors import SpecError
from elastic.memory_model import (
    activation_bytes_per_layer,
    estimate_for_spec,
    estimate_memory,
    layers_per_stage,
    stage_param_count,
    total_param_count,
)
from elastic.model import ModelConfig

# d=128, L=4, a=4, V=512, T=64, mlp_ratio=4.
# Per layer: 12 d^2 + 4d = 196608 + 512 = 197120; x4 = 788480.
# Embeddings 512*128 = 65536, positions 64*128 = 8192, final norm 256, head 65536.
SMALL = ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=512, seq_len=64)
SMALL_PARAMS = 928_000
# s*b*h for micro_batch 4: 64*4*128.
SBH = 32_768


def test_param_count_matches_the_real_model():
    from elastic.model import GPT

    assert total_param_count(SMALL) == SMALL_PARAMS
    assert total_param_count(SMALL) == GPT(SMALL).num_params(non_embedding=False)
    tied = SMALL.model_copy(update={"tie_embeddings": True})
    assert total_param_count(tied) == SMALL_PARAMS - 65_536 == GPT(tied).num_params(non_embedding=False)


def test_stage_param_counts_under_tp_and_pp():
    # tp=2: linears and vocab split, LayerNorms and positions replicated.
    per_layer = 196_608 // 2 + 512
    assert stage_param_count(SMALL, tp=2, pp=2, stage=0) == 2 * per_layer + 32_768 + 8_192
    assert stage_param_count(SMALL, tp=2, pp=2, stage=1) == 2 * per_layer + 256 + 32_768
    assert layers_per_stage(5, 2) == [3, 2]


def test_ddp_fp32_single_rank():
    est = estimate_memory(SMALL, tp=1, pp=1, dp=1, zero=0, micro_batch=4, activation_checkpointing=False)
    assert est.params == 3_712_000  # 928000 * 4
    assert est.grads == 3_712_000
    assert est.optimizer == 7_424_000  # two fp32 AdamW moments
    # Korthikanti: s*b*h*(34 + 5*a*s/h) = 32768 * (34 + 10) bytes at 16 bit, x2 for fp32, x4 layers.
    assert est.activations == SBH * 44 * 2 * 4 == 11_534_336
    assert est.logits == 64 * 4 * 512 * 4 == 524_288
    assert est.total == 26_906_624
    assert est.stage == 0


def test_tp_sp_pp_zero1_worst_stage_is_the_first():
    est = estimate_memory(
        SMALL, tp=2, pp=2, dp=2, zero=1, micro_batch=4, activation_checkpointing=False, sequence_parallel=True
    )
    # Stage 0: 238592 params per rank; 1F1B keeps pp=2 micro-batches in flight there.
    assert est.stage == 0
    assert est.params == est.grads == 238_592 * 4 == 954_368
    assert est.optimizer == 238_592 * 8 // 2 == 954_368  # ZeRO-1 shards the moments
    assert est.activations == 2 * 2 * (SBH * 44 * 2 // 2) == 5_767_168  # 2 layers x 2 in flight, / tp (SP)
    assert est.logits == 0
    # FSDP reduces one block at a time from a flat copy of its grads: 98304 + 512 params at tp 2.
    assert est.buffers == 98_816 * 4 == 395_264
    assert est.total == 9_025_536


def test_sequence_parallel_default_matches_the_tp_plan():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from elastic.parallel.tp import BLOCK_PLAN

    # The TP plan shards no activation along the sequence (dim 1): plain column/row-wise
    # linears, no SequenceParallel style, no sequence-sharded input or output layout.
    assert all(type(style) in (ColwiseParallel, RowwiseParallel) for style in BLOCK_PLAN.values())
    assert not any(Shard(1) in (*style.input_layouts, *style.output_layouts) for style in BLOCK_PLAN.values())
    assert activation_bytes_per_layer(SMALL, 4, 2) == activation_bytes_per_layer(SMALL, 4, 2, sequence_parallel=False)
    assert estimate_memory(SMALL, tp=2, micro_batch=4) == estimate_memory(
        SMALL, tp=2, micro_batch=4, sequence_parallel=False
    )
    assert estimate_memory(SMALL, tp=2, micro_batch=4).activations == 4 * SBH * 27 * 2  # 10 + 24/t + 5as/(ht), fp32


def test_communication_buffers():
    grads = 928_000 * 4
    # Classic DDP: the reducer's buckets copy every gradient; one replica needs none.
    assert estimate_memory(SMALL, dp=2, micro_batch=4).buffers == grads
    assert estimate_memory(SMALL, dp=1, micro_batch=4).buffers == 0
    # replicate (DP with TP): the flat reduction input of one block.
    assert estimate_memory(SMALL, dp=2, tp=2, micro_batch=4).buffers == 98_816 * 4
    # ZeRO-2: that plus the block's unsharded grads before the reduce-scatter.
    assert estimate_memory(SMALL, dp=4, zero=2, micro_batch=4).buffers == 2 * 197_120 * 4


def test_mixed_precision_zero3_with_recompute():
    est = estimate_memory(SMALL, tp=1, pp=1, dp=4, zero=3, micro_batch=4, activation_checkpointing=True, dtype_bytes=2)
    assert est.params == est.grads == 928_000 * 2 // 4 == 464_000
    assert est.optimizer == 928_000 * 12 // 4 == 2_784_000  # fp32 master + 2 moments, sharded
    # Each layer's 16-bit input, plus one layer rebuilt at a time in backward.
    assert est.activations == 4 * 2 * SBH + SBH * 44 == 1_703_936
    assert est.logits == 524_288
    # Two blocks for the reduce-scatter (flat input + unsharded grads), one gathered block,
    # and the root (embeddings, positions, final norm, head: 139520 params) unsharded.
    block, root = 197_120 * 2, 139_520 * 2
    assert est.buffers == 2 * block + block + root - root // 4 == 1_392_000
    assert est.total == 7_332_224


@pytest.mark.parametrize(
    "tp, sp, recompute, dtype_bytes, expected",
    [
        (1, True, False, 2, SBH * 44),  # the paper's formula exactly
        (2, True, False, 2, SBH * 44 // 2),  # TP + SP: / t
        (2, False, False, 2, SBH * (10 + 12 + 5)),  # 10 + 24/t + 5as/(ht)
        (2, False, False, 4, SBH * 27 * 2),
        (1, True, True, 2, 2 * SBH),
        (2, True, True, 4, 2 * SBH),  # recompute: 2sbh / t, x2 for fp32
    ],
)
def test_activation_formula(tp, sp, recompute, dtype_bytes, expected):
    got = activation_bytes_per_layer(SMALL, 4, tp, recompute=recompute, sequence_parallel=sp, dtype_bytes=dtype_bytes)
    assert got == expected


def test_pipeline_schedules():
    cfg = SMALL.model_copy(update={"n_layers": 8})
    layer = activation_bytes_per_layer(cfg, 1)
    f1b = estimate_memory(cfg, pp=4, micro_batch=1)
    assert f1b.stage == 0 and f1b.activations == 2 * layer * 4  # 2 layers x pp micro-batches
    few = estimate_memory(cfg, pp=4, micro_batch=1, num_microbatches=2)
    assert few.activations == 2 * layer * 2
    gpipe = estimate_memory(cfg, pp=4, micro_batch=1, pp_schedule="gpipe", num_microbatches=8)
    assert gpipe.activations == 2 * layer * 8


def test_each_zero_level_and_recompute_saves_memory():
    totals = [estimate_memory(SMALL, dp=4, zero=z, micro_batch=4).total for z in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    assert (
        estimate_memory(SMALL, micro_batch=4, activation_checkpointing=True).total
        < estimate_memory(SMALL, micro_batch=4).total
    )


def test_estimate_for_spec_duck_typed():
    spec = SimpleNamespace(
        model=SMALL,
        parallel=SimpleNamespace(tp=1, pp=1, zero=0, micro_batch=4, activation_checkpointing=False, pp_schedule="1f1b"),
        grad_accum=lambda dp: 12 // dp,
    )
    assert estimate_for_spec(spec, dp=1).total == 26_906_624
    assert estimate_for_spec(spec, dp=1).fits(27e6 / 0.9) and not estimate_for_spec(spec, dp=1).fits(20e6)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(zero=4), "parallel.zero"),
        (dict(dtype_bytes=3), "dtype_bytes"),
        (dict(optimizer="lion"), "optimizer"),
        (dict(pp=5), "parallel.pp"),
        (dict(tp=0), "parallel.tp"),
        (dict(pp_schedule="zb"), "parallel.pp_schedule"),
    ],
)
def test_bad_inputs(kwargs, field):
    with pytest.raises(SpecError) as info:
        estimate_memory(SMALL, **kwargs)
    assert info.value.field == field
