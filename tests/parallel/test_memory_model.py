"""The analytical memory model against hand-computed answers for small configs.

Every expected figure is worked out in the comments from the module's rules (docs/sweep.md,
"How the memory model counts"); the per-layer coefficients themselves are checked against
live tensor bytes of the real models at the end of this file, and whole layouts against
measured peaks in tests/test_memory_model_measured.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from elastic.errors import SpecError
from elastic.models.config import LlamaConfig
from elastic.models.gpt import ModelConfig
from elastic.parallel.memory_model import (
    ExtraTerms,
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
# One micro-batch of 4: 256 tokens; U = tokens * d = 32768 (bytes per "byte per token and d").
U = 32_768
BLOCK = 197_120
# GPT fp32 coefficients (bytes per token and d): whole 16, split 16 + 8r = 48, so 64 a layer;
# the last stage adds 8 (final norm in and out); a layer's backward holds 8r = 32 of activation
# gradients. Autocast: whole 16, split 8 + 4r = 24, head 6, backward 16.
# A vocabulary the size of the logits: 4 bytes of log-probabilities kept per token and entry,
# 8 more (their gradient, the logits' gradient) when backward starts: 256 * 512 * (4, 8).
LOGP, LOSS_GRADS = 524_288, 1_048_576
# The paper's model stores the softmax (5as/h) and declares no per-precision coefficients.
PAPER = dataclasses.replace(SMALL.memory_inputs(), act_scores=5, act_fp32=None, act_autocast=None, act_bf16=None)
# A large vocabulary on a small model: the loss dominates (d=64, L=2, V=8192).
BIGV = ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=8192, seq_len=64)


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


def test_vocabulary_split_only_where_the_tp_plan_splits_it():
    # tp=4: the untied tables are split by vocabulary (512 % 4 == 0) ...
    layers = 4 * (196_608 // 4 + 512)
    assert stage_param_count(SMALL, 4, 1, 0) == layers + 16_384 + 8_192 + 16_384 + 256
    # ... a tied table is replicated (the plan shards untied ones only) ...
    tied = SMALL.model_copy(update={"tie_embeddings": True})
    assert stage_param_count(tied, 4, 1, 0) == layers + 65_536 + 8_192 + 256
    # ... and so is a vocabulary that 4 does not divide (502 rows, twice).
    odd = SMALL.model_copy(update={"vocab_size": 502})
    assert stage_param_count(odd, 4, 1, 0) == layers + 2 * 502 * 128 + 8_192 + 256


def test_logits_split_by_tp_where_the_head_is_vocab_parallel():
    # Micro-batches of 16: 1024 tokens. The loss's terms per token and vocabulary entry: 4
    # (log-probs) + 8 (two gradients) = 12 with the whole vocabulary, 4 + 4 under
    # loss_parallel (it fuses the two gradients), on V / tp entries.
    split = estimate_memory(BIGV, tp=4, micro_batch=16)
    assert split.logits == 1024 * 2048 * (4 + 4) == 16_777_216
    tied = estimate_memory(BIGV.model_copy(update={"tie_embeddings": True}), tp=4, micro_batch=16)
    assert tied.logits == 1024 * 8192 * 12 == 100_663_296  # what the old model counted at every tp
    assert estimate_memory(BIGV, micro_batch=16).logits == 100_663_296


def test_ddp_fp32_single_rank():
    est = estimate_memory(SMALL, micro_batch=4)
    assert est.params == 3_712_000  # 928000 * 4
    assert est.optimizer == 7_424_000  # two fp32 AdamW moments
    # Stored: 4 layers x 64U + 8U (final norm) = 8650752. The peak is the last layer's
    # backward (10487808), above backward's start (stored + 4 + 8 of loss = 10223616) and its
    # end (all gradients 3712000 + the largest block's 788480 + one layer 2097152): the
    # layer's weight gradients (197120 * 4) and 32U of activation gradients.
    assert est.grads == BLOCK * 4 == 788_480
    assert est.activations == 264 * U + 32 * U == 9_699_328
    assert est.logits == 0 and est.buffers == est.pipeline == 0
    assert est.total == 3_712_000 + 7_424_000 + 788_480 + 9_699_328 == 21_623_808
    # With gradient accumulation the earlier micro-batches' gradients are held too.
    accum = estimate_memory(SMALL, micro_batch=4, num_microbatches=2)
    assert accum.grads == 3_712_000 + 788_480 and accum.total == 21_623_808 + 3_712_000


def test_autocast_keeps_fp32_state_and_a_16_bit_copy_of_every_linear_weight():
    est = estimate_memory(SMALL, micro_batch=4, compute_dtype_bytes=2)
    assert (est.params, est.optimizer) == (3_712_000, 7_424_000)  # fp32 master weights and moments
    # The cached bf16 copies: 4 blocks' linears (196608 each) and the head (65536), x2 bytes.
    assert est.buffers == (4 * 196_608 + 65_536) * 2 == 1_703_936
    # Backward starts: 4 x 40U + 6U = 166U stored, the fp32 loss terms as in fp32.
    assert est.activations == 166 * U == 5_439_488
    assert est.logits == LOGP + LOSS_GRADS and est.grads == 0
    assert est.total == 3_712_000 + 7_424_000 + 1_703_936 + 5_439_488 + 1_572_864 == 19_852_288


def test_recompute_keeps_each_layer_input_and_rebuilds_one_layer():
    est = estimate_memory(SMALL, micro_batch=4, activation_checkpointing=True)
    # Stored: 4 layers' inputs (fp32 residual, 4U) + 8U = 786432. Backward ends is the peak:
    # all gradients, the largest block's temporary, one layer (64U).
    assert est.grads == 3_712_000 + 788_480
    assert est.activations == 64 * U == 2_097_152
    assert est.total == 3_712_000 + 7_424_000 + 4_500_480 + 2_097_152 == 17_733_632
    assert activation_bytes_per_layer(SMALL, 4, recompute=True) == 4 * U
    # Under autocast the residual stream stays fp32: recompute keeps 4 bytes, not 2.
    assert activation_bytes_per_layer(SMALL, 4, recompute=True, precision="autocast") == 4 * U


def test_pipeline_buffers_and_micro_batches_in_flight():
    from elastic.parallel.memory_model import _context
    from elastic.parallel.memory_terms import pipeline_bytes

    m = SMALL.model_copy(update={"n_layers": 8}).memory_inputs()
    acts = m.act_fp32

    def pipe(stage, microbatches=8, schedule="1f1b"):
        ctx = _context(m, tp=2, pp=4, dp=1, zero=0, stage=stage, micro_batch=1, microbatches=microbatches,
                       schedule=schedule)  # fmt: skip
        return ctx.in_flight, pipeline_bytes(m, ctx, acts)

    # Micro-batches of 1: a stage I/O tensor is 64 tokens x 128 x 4 bytes = 32768 (whole under
    # TP). The first stage receives gradients only, the last activations only, the others
    # both, 8 each; all but the last keep the outputs of their micro-batches in flight
    # (1F1B: 4 - stage of them).
    assert [pipe(s) for s in range(4)] == [
        (4, (8 + 4) * 32_768),
        (3, (16 + 3) * 32_768),
        (2, (16 + 2) * 32_768),
        (1, 8 * 32_768),
    ]
    # GPipe, or 1F1B with fewer micro-batches than stages (torch falls back), holds them all.
    assert pipe(0, schedule="gpipe") == (8, (8 + 8) * 32_768)
    assert pipe(3, microbatches=2) == (2, 2 * 32_768)
    # The worst stage of the whole estimate is the first (most micro-batches in flight).
    cfg = SMALL.model_copy(update={"n_layers": 8})
    assert estimate_memory(cfg, pp=4, micro_batch=1, num_microbatches=8).stage == 0


def test_zero3_shards_state_and_gathers_one_block_at_a_time():
    est = estimate_memory(SMALL, dp=4, zero=3, micro_batch=4)
    assert est.params == SMALL_PARAMS * 4 // 4 and est.optimizer == SMALL_PARAMS * 8 // 4
    # Unsharded: the block computed, the next prefetched, and the root (embeddings, positions,
    # final norm, head: 139520) kept; the reduce-scatter buffers exist only at backward's end,
    # which is not the peak here.
    assert est.buffers == (2 * BLOCK + 139_520) * 4 == 2_135_040
    assert est.total == 928_000 + 1_856_000 + 2_135_040 + 788_480 + 9_699_328 == 15_406_848
    # With accumulation ZeRO-1 keeps unsharded fp32 gradients, ZeRO-2/3 sharded ones.
    z1 = estimate_memory(SMALL, dp=4, zero=1, micro_batch=4, num_microbatches=4)
    z2 = estimate_memory(SMALL, dp=4, zero=2, micro_batch=4, num_microbatches=4)
    assert z1.grads - z2.grads == SMALL_PARAMS * 4 - SMALL_PARAMS


def test_dp_wrappers_and_their_copies():
    grads = SMALL_PARAMS * 4
    # Classic DDP: the reducer's buckets copy every gradient; one replica needs none.
    assert estimate_memory(SMALL, dp=2, micro_batch=4).buffers == grads
    assert estimate_memory(SMALL, dp=1, micro_batch=4).buffers == 0
    # replicate (DP with TP or PP) keeps an unsharded copy of every parameter (at tp=2: 469248).
    assert estimate_memory(SMALL, dp=2, tp=2, micro_batch=4).buffers == 469_248 * 4
    # bf16 with zero >= 1: FSDP at dp=1 too, every unit gathered in bf16 for the step
    # (ZeRO-1/2); the peak is backward's end, where one block is reduced (fp32, 197120 * 4).
    fsdp = estimate_memory(SMALL, dp=1, zero=1, micro_batch=4, compute_dtype_bytes=2)
    assert fsdp.buffers == SMALL_PARAMS * 2 + BLOCK * 4 and fsdp.params == SMALL_PARAMS * 4


def test_embedding_gradient_is_full_size_under_tp():
    # torch's DTensor embedding backward returns a replicated [V, d] gradient even where the
    # table is split: with accumulation, held gradients count the whole table (8192 * 64).
    est = estimate_memory(BIGV, tp=4, micro_batch=4, num_microbatches=2)
    split = stage_param_count(BIGV, 4, 1, 0)
    assert est.grads >= (split + 8192 * 64 * 3 // 4) * 4


def test_extra_terms_hook():
    seen = []

    def extra(ctx):
        seen.append((ctx.stage, ctx.tp, ctx.precision, ctx.in_flight))
        return ExtraTerms(param_count=1000, activation_bytes=4096, buffer_bytes=7)

    base = SMALL.memory_inputs()
    hooked = dataclasses.replace(base, extra_terms=extra)
    a = estimate_memory(base, micro_batch=4)
    b = estimate_memory(hooked, micro_batch=4)
    assert seen == [(0, 1, "fp32", 1)]
    # 1000 more parameters: 4 + 8 bytes of state each; 4096 stored; 7 held.
    assert b.params - a.params == 4000 and b.optimizer - a.optimizer == 8000
    assert b.activations - a.activations == 4096 and b.buffers - a.buffers == 7


def test_precision_regimes():
    from elastic.parallel.memory_model import _context

    m = SMALL.memory_inputs()

    def regime(dtype, compute, zero, dp=1):
        ctx = _context(m, tp=1, pp=1, dp=dp, zero=zero, stage=0, micro_batch=1, microbatches=1,
                       dtype_bytes=dtype, compute_dtype_bytes=compute)  # fmt: skip
        return ctx.precision, ctx.fsdp

    assert regime(4, None, 0) == ("fp32", False)
    assert regime(4, 2, 0) == ("autocast", False)
    assert regime(4, 2, 1) == ("bf16", True)  # FSDP's bf16 policy, even at dp 1
    assert regime(4, None, 1) == ("fp32", False)  # fp32 ZeRO at dp 1: no FSDP
    assert regime(2, None, 0) == ("bf16", False)


def test_sequence_parallelism_is_not_modelled():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from elastic.parallel.tp import BLOCK_PLAN

    # The TP plan shards no activation along the sequence (dim 1) ...
    assert all(type(style) in (ColwiseParallel, RowwiseParallel) for style in BLOCK_PLAN.values())
    assert not any(Shard(1) in (*style.input_layouts, *style.output_layouts) for style in BLOCK_PLAN.values())
    # ... so the model has no such option: the whole part stays whole under TP.
    with pytest.raises(TypeError):
        estimate_memory(SMALL, tp=2, sequence_parallel=True)
    assert activation_bytes_per_layer(SMALL, 4, 2) == (16 + 48 / 2) * U


@pytest.mark.parametrize(
    "tp, recompute, expected",
    [
        (1, False, U * (34 + 10)),  # Korthikanti et al.: sbh(34 + 5as/h) at 16 bits, 5as/h = 10 here
        (2, False, U * (10 + 12 + 5)),  # sbh(10 + 24/t + 5as/(ht))
        (1, True, 2 * U),  # full recompute: 2sbh
    ],
)
def test_paper_formula_for_a_model_without_declared_coefficients(tp, recompute, expected):
    assert activation_bytes_per_layer(PAPER, 4, tp, recompute=recompute, precision="bf16") == expected


def test_estimate_for_spec_duck_typed():
    spec = SimpleNamespace(
        model=SMALL,
        parallel=SimpleNamespace(tp=1, pp=1, zero=0, micro_batch=4, activation_checkpointing=False, pp_schedule="1f1b"),
        grad_accum=lambda dp: 12 // dp,
    )
    # 12 micro-batches: the gradients are held at the peak.
    assert estimate_for_spec(spec, dp=1).total == 21_623_808 + 3_712_000 == 25_335_808
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


# --------------------------------------------------------------------------- live bytes


def _live_bytes(cfg, precision: str, n_layers: int) -> int:
    """Live tensor bytes beyond the parameters that the forward of the real model stores for
    one micro-batch of 2, the logits excepted (autocast on CPU stands in for CUDA's)."""
    import contextlib

    import torch

    from elastic.models.spec import model_spec
    from elastic.parallel.memtrack import LiveTensorBytes

    cfg = cfg.model_copy(update={"n_layers": n_layers})
    model = model_spec(cfg).build_full(0)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    tracker = LiveTensorBytes(torch.device("cpu"))
    with tracker, autocast:
        tracker.register(list(model.parameters()) + [x])
        base = tracker.current
        logits = model(x)
        return tracker.current - base - logits.untyped_storage().nbytes()


LLAMA = LlamaConfig(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, vocab_size=512, seq_len=64, multiple_of=32)


@pytest.mark.parametrize("cfg", [SMALL.model_copy(update={"seq_len": 32}), LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "autocast", "bf16"])
def test_declared_coefficients_match_live_bytes(cfg, precision):
    """Each model's stored bytes per layer and before its head, at each precision, as the
    real model keeps them: within 2% (a few per-row statistics are not counted)."""
    m = cfg.memory_inputs()
    acts = m.activations(precision, 4 if precision == "fp32" else 2, 4)
    tokens, d = 2 * cfg.seq_len, cfg.d_model
    two, four = _live_bytes(cfg, precision, 2), _live_bytes(cfg, precision, 4)
    casts = m.block_split * 2 if precision == "autocast" else 0  # autocast's cached bf16 weights, per block
    per_layer = (four - two) / 2 - casts
    assert per_layer == pytest.approx(tokens * d * (acts.whole + acts.split), rel=0.02)
    # Before the head: the final norm's tensors and the head's input (and its weight's copy).
    head = two - 2 * (per_layer + casts) - (m.head_params * 2 if casts else 0)
    assert head == pytest.approx(tokens * d * acts.head, rel=0.02, abs=4096)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_terms_match_live_bytes(dtype):
    """The loss keeps 4 bytes of fp32 log-probabilities per token and vocabulary entry and
    adds 8 (their gradient, the logits' gradient) when backward starts, whatever the
    logits' dtype (the loss upcasts them)."""
    import torch

    from elastic.models.spec import lm_loss
    from elastic.parallel.memtrack import LiveTensorBytes

    tokens, vocab = 256, 4096
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, tokens // 2, vocab, generator=gen).to(getattr(torch, dtype)).requires_grad_()
    targets = torch.randint(0, vocab, (2, tokens // 2), generator=gen)
    tracker = LiveTensorBytes(torch.device("cpu"))
    with tracker:
        tracker.register([logits, targets])
        base = tracker.current
        loss = lm_loss(logits, targets)
        kept = tracker.current - base
        tracker.peak = tracker.current
        loss.backward()
        transient = tracker.peak - base - kept
    assert kept == pytest.approx(tokens * vocab * 4, abs=64)
    assert transient == pytest.approx(tokens * vocab * 8, abs=64)
