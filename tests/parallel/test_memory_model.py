"""The analytical memory model against hand-computed answers for small configs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from elastic.errors import SpecError
from elastic.models.gpt import ModelConfig
from elastic.parallel.memory_model import (
    activation_bytes_per_layer,
    estimate_for_spec,
    estimate_memory,
    layers_per_stage,
    stage_param_count,
    total_param_count,
)

# d=128, L=4, a=4, V=512, T=64, mlp_ratio=4.
# Per layer: 12 d^2 + 4d = 196608 + 512 = 197120; x4 = 788480.
# Embeddings 512*128 = 65536, positions 64*128 = 8192, final norm 256, head 65536.
SMALL = ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=512, seq_len=64)
SMALL_PARAMS = 928_000
# s*b*h for micro_batch 4: 64*4*128.
SBH = 32_768
LOGP = 64 * 4 * 512 * 4  # s*b*V fp32 log-probabilities at micro_batch 4

# The paper's model stores the softmax (5as/h: 5 * 4 * 64 / 128 = 10 per sbh here); the
# built-in GPT's fused attention stores none (act_scores = 0).
SOFTMAX = dataclasses.replace(SMALL.memory_inputs(), act_scores=5)


def test_param_count_matches_the_real_model():
    from elastic.models.gpt import GPT

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
    assert est.optimizer == 7_424_000  # two fp32 AdamW moments
    # The peak is where backward starts: every activation stored, the log-probabilities plus
    # their gradient and the logits' gradient, and no parameter gradient yet (one
    # micro-batch; zero_grad(set_to_none=True) freed the last step's).
    assert est.grads == 0
    # Korthikanti with fused attention: s*b*h*34 = 32768 * 34 bytes at 16 bit, x2 for fp32, x4 layers.
    assert est.activations == SBH * 34 * 2 * 4 == 8_912_896
    assert est.logits == 3 * LOGP == 1_572_864
    assert est.total == 3_712_000 + 7_424_000 + 8_912_896 + 1_572_864 == 21_621_760
    assert est.stage == 0
    # With gradient accumulation the gradients of the earlier micro-batches are held too.
    accum = estimate_memory(SMALL, micro_batch=4, num_microbatches=2)
    assert accum.grads == 3_712_000 and accum.total == 21_621_760 + 3_712_000
    # The paper's softmax term, for a model that stores it: + 10 sbh per layer at 16 bit.
    assert estimate_memory(SOFTMAX, micro_batch=4).activations == SBH * 44 * 2 * 4


def test_tp_sp_pp_zero1_worst_stage_is_the_first():
    est = estimate_memory(
        SMALL, tp=2, pp=2, dp=2, zero=1, micro_batch=4, activation_checkpointing=False, sequence_parallel=True
    )
    # Stage 0: 238592 params per rank; 1F1B keeps pp=2 micro-batches in flight there, and
    # the gradients of the first are held when the second's backward starts.
    assert est.stage == 0
    assert est.params == est.grads == 238_592 * 4 == 954_368
    assert est.optimizer == 238_592 * 8 // 2 == 954_368  # ZeRO-1 shards the moments
    assert est.activations == 2 * 2 * (SBH * 34 * 2 // 2) == 4_456_448  # 2 layers x 2 in flight, / tp (SP)
    assert est.logits == 0
    # FSDP reduces one block at a time from a flat copy of its grads: 98304 + 512 params at tp 2.
    assert est.buffers == 98_816 * 4 == 395_264
    assert est.total == 3 * 954_368 + 4_456_448 + 395_264 == 7_714_816
    # Stage 1 (230656 params: 2 layers, final norm, half the head; 1 micro-batch in flight,
    # 3 x the log-probabilities) is smaller: 230656 * 12 + 395264 + 2 * 1114112 + 3 * LOGP.
    assert 230_656 * 12 + 395_264 + 2 * 1_114_112 + 3 * LOGP == 6_964_224 < est.total


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
    assert estimate_memory(SMALL, tp=2, micro_batch=4).activations == 4 * SBH * 22 * 2  # 10 + 24/t (fused), fp32


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
    assert est.params == 928_000 * 2 // 4 == 464_000
    assert est.optimizer == 928_000 * 12 // 4 == 2_784_000  # fp32 master + 2 moments, sharded
    # The peak is the first recompute: each layer's 16-bit input, one layer rebuilt (34 sbh),
    # the log-probabilities counted until then, no parameter gradient yet (one micro-batch).
    assert est.grads == 0
    assert est.activations == 4 * 2 * SBH + SBH * 34 == 1_376_256
    assert est.logits == LOGP == 524_288
    # Two blocks for the reduce-scatter (flat input + unsharded grads), one gathered block,
    # and the root (embeddings, positions, final norm, head: 139520 params) unsharded.
    block, root = 197_120 * 2, 139_520 * 2
    assert est.buffers == 2 * block + block + root - root // 4 == 1_392_000
    assert est.total == 464_000 + 2_784_000 + 1_392_000 + 1_376_256 + 524_288 == 6_540_544


@pytest.mark.parametrize(
    "cfg, tp, sp, recompute, dtype_bytes, expected",
    [
        (SOFTMAX, 1, True, False, 2, SBH * 44),  # the paper's formula exactly
        (SOFTMAX, 2, True, False, 2, SBH * 44 // 2),  # TP + SP: / t
        (SOFTMAX, 2, False, False, 2, SBH * (10 + 12 + 5)),  # 10 + 24/t + 5as/(ht)
        (SOFTMAX, 2, False, False, 4, SBH * 27 * 2),
        (SMALL, 1, True, False, 2, SBH * 34),  # fused attention: no 5as/h
        (SMALL, 2, False, False, 2, SBH * (10 + 12)),
        (SMALL, 1, True, True, 2, 2 * SBH),
        (SMALL, 2, True, True, 4, 2 * SBH),  # recompute: 2sbh / t, x2 for fp32
    ],
)
def test_activation_formula(cfg, tp, sp, recompute, dtype_bytes, expected):
    got = activation_bytes_per_layer(cfg, 4, tp, recompute=recompute, sequence_parallel=sp, dtype_bytes=dtype_bytes)
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
    # With gradient accumulation (gradients held at the peak) every ZeRO level saves memory.
    totals = [estimate_memory(SMALL, dp=4, zero=z, micro_batch=4, num_microbatches=4).total for z in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    # At one micro-batch the peak holds no gradient: sharding them (ZeRO-2) saves nothing
    # there, and its unsharded-gradient buffer costs one block.
    one = [estimate_memory(SMALL, dp=4, zero=z, micro_batch=4).total for z in (1, 2)]
    assert one[1] - one[0] == 197_120 * 4
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
    # 12 micro-batches: the gradients are held at the peak.
    assert estimate_for_spec(spec, dp=1).total == 21_621_760 + 3_712_000 == 25_333_760
    assert estimate_for_spec(spec, dp=1).fits(26e6 / 0.9) and not estimate_for_spec(spec, dp=1).fits(20e6)


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


def _live_bytes(cfg, micro_batch: int) -> tuple[int, int]:
    """(bytes stored by the forward pass and the loss, peak over backward), live tensor bytes
    beyond the parameters, for one micro-batch of the real GPT in fp32 on one process."""
    import torch

    from elastic.models.gpt import GPT
    from elastic.models.spec import lm_loss
    from elastic.parallel.memtrack import LiveTensorBytes

    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = (torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len)) for _ in range(2))
    tracker = LiveTensorBytes(torch.device("cpu"))
    with tracker:
        tracker.register(list(model.parameters()))
        base = tracker.current
        loss = lm_loss(model(x), y)
        stored = tracker.current - base
        tracker.peak = tracker.current
        loss.backward()
        return stored, tracker.peak - base


def test_fused_attention_and_loss_terms_match_live_bytes():
    """The model's two measured claims, on the real model: fused attention stores nothing
    that grows with s^2, and the peak adds two log-probability-sized tensors when backward
    starts."""
    per_sbh = []
    for seq_len in (64, 256):
        cfg = SMALL.model_copy(update={"seq_len": seq_len})
        stored, peak = _live_bytes(cfg, micro_batch=4)
        sbh, logp = seq_len * 4 * 128, seq_len * 4 * 512 * 4
        per_sbh.append((stored - logp) / sbh)
        assert peak - stored == 2 * logp  # exact: the gradients of the log-probabilities and logits
    # Nothing quadratic in s: the same bytes per s*b*h at s = 64 and 256 (the paper's
    # 5as/h would add 10 and 40 per sbh at 16 bit).
    assert per_sbh[0] == pytest.approx(per_sbh[1], rel=1e-3)
    # Per layer at most the formula's 34 sbh at 16 bit (x2 in fp32); the GPT's has no dropout masks.
    layer = per_sbh[0] / SMALL.n_layers / 2
    assert 30 <= layer <= 34, layer
