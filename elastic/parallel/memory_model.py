"""Analytical per-rank memory of a transformer (any ``model.kind``), in bytes.

A model describes itself through ``MemoryInputs`` (parameter counts per block, per first
and last stage, activation coefficients); the formulas below are written for the
reference GPT (``elastic/models/gpt.py``) and read those inputs, so Llama and custom
models use the same arithmetic (``elastic/models/config.py`` derives their inputs).

Used to prune parallel configurations before measuring them (step 1 of the search:
fit the model in memory). Pure arithmetic; every figure is an integer number of bytes.

**Parameters** of ``GPT`` (d = d_model, r = mlp_ratio, V = vocab, T = seq_len)::

    tok_emb V*d   pos_emb T*d   per layer (4 + 2r) d^2 + 4d (two LayerNorms)
    final norm 2d   head V*d unless tied (tying needs pp = 1)

Under TP the linears and the embedding/head (vocab-parallel) are split ``tp`` ways; the
LayerNorms and the position embedding are replicated. Under PP each stage holds its
layers; stage 0 adds the embeddings, the last stage the final norm and the head. The
estimate is the worst stage (largest total).

**Training state** per parameter, ``k = dtype_bytes``:

* params ``k`` and grads ``k``;
* AdamW: two fp32 moments (8 bytes), plus a 4-byte fp32 master copy when ``k < 4``
  (mixed precision, the ``2 + 2 + 12`` bytes of the ZeRO paper); SGD: one momentum;
* ZeRO-1 divides the optimizer state by ``dp``, ZeRO-2 also the grads, ZeRO-3 also the
  params.

**Communication buffers** (``buffers``, with ``dp > 1``), as the engine's DP wrappers
(``elastic/parallel/ddp.py``, ``fsdp.py``) allocate them:

* classic DDP (pure DP, zero 0): the reducer's buckets hold a second copy of every
  gradient (``gradient_as_bucket_view`` is off): ``+ grads``;
* FSDP2 and ``replicate`` (every other DP layout) reduce one unit (a transformer block) at
  a time from a flat copy of its gradients: ``+ one block's gradients``; ZeRO-2/3, whose
  ``grads`` term is the sharded accumulator, also hold the unit's unsharded gradients as
  autograd produced them: ``+ one more block``;
* ZeRO-3 all-gathers one block's parameters at a time (``+ one block``), and the root
  unit (embeddings, final norm, head) stays unsharded through the step
  (``reshard_after_forward=False``): ``+ its full size minus its shard``.

A block's size is that of this stage's block at its TP split.

**Activations** per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Table 2), for 16-bit activations::

    s*b*h * (34 + 5*a*s/h)                     no TP, or TP with sequence parallelism: / t
    s*b*h * (10 + 24/t + 5*a*s/(h*t))          TP without sequence parallelism
    2*s*b*h                                    full recompute (only each layer's input; / t with SP)

With full recompute, backward rebuilds one layer's activations at a time: that working
set (one layer of the no-recompute formula) is added once, on top of the stored inputs.

The 34 splits into 10 bytes kept whole by TP without SP (LayerNorm inputs, the inputs of
the QKV and first MLP matmuls, two dropout masks) and 24 split by TP; the MLP part of
the 24 is ``4r`` (16 at r = 4), so the code uses ``10 + 8 + 4r``. The ``5as/h`` term is
the stored softmax (scores, dropout mask, output). The built-in GPT and Llama call the
fused ``scaled_dot_product_attention``, which stores no ``s x s`` matrix: they declare
``act_scores = 0`` (measured: the live bytes per ``sbh`` do not change from s = 64 to 256).
The GPT has no dropout, so its two masks (2 sbh) stay as a small over-count (measured 32.1
per layer against the formula's 34). Activations in ``dtype_bytes``
other than 2 scale the whole formula by ``dtype_bytes / 2`` (fp32 doubles it).

**Pipeline**: with 1F1B, stage ``i`` of ``pp`` holds the activations of up to ``pp - i``
micro-batches at once (stage 0 the most); with GPipe every stage holds all of them.
**Logits**: the last stage's loss (``lm_loss``, in fp32, not split by TP: the loss sees
the full vocabulary) keeps its ``s*b*V`` log-probabilities for backward, and the first
step of backward holds two more tensors of that size (their gradient and the logits'
gradient) while every activation is still stored: ``3*s*b*V*4`` bytes at the peak
(measured exactly, for V from 512 to 8192).

**The peak** is the largest of three moments of a step (measured with the live-tensor
tracker, ``elastic/parallel/memtrack.py``):

* backward starts: every stored activation and ``3*s*b*V*4`` of loss tensors;
* with full recompute, the first layer rebuilt: the stored inputs plus that layer's working
  set (the log-probabilities are counted until then: a small margin);
* backward ends: all the parameter gradients and one layer's activations.

Parameter gradients count at the first two only under gradient accumulation (or a
pipeline's several micro-batches): at one micro-batch the last step's were freed
(``zero_grad(set_to_none=True)``) and this step's do not exist yet. ``grads``,
``activations`` and ``logits`` in the estimate are those of the peak moment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic.errors import SpecError
from elastic.parallel.memory_terms import STATE_BYTES as _STATE_BYTES
from elastic.parallel.memory_terms import layers_per_stage


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory model needs to know about a model (per unsplit block or stage).

    ``*_split`` parameters are divided by TP, ``*_whole`` ones replicated. ``act_whole``
    and ``act_split`` are the stored activation bytes per ``s*b*h`` of one layer at 16
    bits, kept whole / split by TP without sequence parallelism (the GPT's 10 and
    ``8 + 4r``). ``act_scores`` is the attention-score coefficient per ``a*s^2*b`` (added
    to the split part): 5 for attention that stores its softmax (the paper's ``5as/h``), 0
    for a fused kernel (``scaled_dot_product_attention``), which keeps only a per-row
    log-sum-exp.
    """

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    block_split: int
    block_whole: int
    first_split: int
    first_whole: int
    last_split: int
    last_whole: int
    act_whole: float = 10
    act_split: float = 24
    act_scores: float = 5
    experts: Any = None  # a MoE model's routed experts: elastic.parallel.memory_moe.ExpertMemory


def memory_inputs(cfg: Any) -> MemoryInputs:
    """``cfg`` itself if it is ``MemoryInputs``, else what the model config derives."""
    if isinstance(cfg, MemoryInputs):
        return cfg
    if hasattr(cfg, "memory_inputs"):
        return cfg.memory_inputs()
    raise SpecError("model", f"no memory-model inputs for {type(cfg).__name__}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank on the worst pipeline stage (``stage``)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    total: int
    stage: int = 0
    buffers: int = 0

    def fits(self, capacity_bytes: float, headroom: float = 0.9) -> bool:
        """True if ``total`` stays under ``headroom`` of the device memory."""
        return self.total <= capacity_bytes * headroom

    def __str__(self) -> str:
        gib = 1 << 30
        fields = ("params", "grads", "optimizer", "buffers", "activations", "logits")
        parts = ", ".join(f"{k}={getattr(self, k) / gib:.3f}" for k in fields)
        return f"{self.total / gib:.3f} GiB (stage {self.stage}: {parts})"


def stage_param_count(cfg: Any, tp: int, pp: int, stage: int) -> int:
    """Parameters held by one rank of ``stage`` (split by TP, not by ZeRO)."""
    m = memory_inputs(cfg)
    n = layers_per_stage(m.n_layers, pp)[stage] * block_param_count(m, tp)
    if stage == 0:
        n += _ceil(m.first_split, tp) + m.first_whole
    if stage == pp - 1:
        n += _ceil(m.last_split, tp) + m.last_whole
    return n


def block_param_count(cfg: Any, tp: int = 1) -> int:
    """Parameters of one transformer block on one rank (linears split by TP, norms whole)."""
    m = memory_inputs(cfg)
    return _ceil(m.block_split, tp) + m.block_whole


def total_param_count(cfg: Any) -> int:
    """All parameters of the unsplit model (equals the built model's parameter count)."""
    return stage_param_count(cfg, 1, 1, 0)


def activation_bytes_per_layer(
    cfg: Any,
    micro_batch: int,
    tp: int = 1,
    *,
    recompute: bool = False,
    sequence_parallel: bool = False,
    dtype_bytes: int = 4,
) -> int:
    """Stored activations of one transformer layer for one micro-batch on one rank."""
    m = memory_inputs(cfg)
    s, b, h, a = m.seq_len, micro_batch, m.d_model, m.n_heads
    sbh = s * b * h
    sp = sequence_parallel or tp == 1
    if recompute:
        num, den = 2 * sbh, (tp if sp else 1)
    else:
        kept_whole = round(m.act_whole * sbh)
        split = round(m.act_split * sbh + m.act_scores * a * s * s * b)  # (5as/h) * sbh = 5 a s^2 b
        num, den = (kept_whole + split, tp) if sp else (kept_whole * tp + split, tp)
    # num / den bytes at 16 bits; scale by dtype_bytes / 2.
    return _ceil(num * dtype_bytes, den * 2)


def estimate_memory(
    model_cfg: Any,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    zero: int = 0,
    micro_batch: int = 1,
    activation_checkpointing: bool = False,
    dtype_bytes: int = 4,
    optimizer: str = "adamw",
    *,
    sequence_parallel: bool = False,
    pp_schedule: str = "1f1b",
    num_microbatches: int | None = None,
    compute_dtype_bytes: int | None = None,
    ep: int = 1,
    cp: int = 1,
) -> MemoryEstimate:
    """Per-rank memory of the worst pipeline stage; see the module doc for the model.

    ``compute_dtype_bytes=2`` with ``dtype_bytes=4`` is the engine's ``train.dtype: bf16``:
    fp32 parameters, gradients and optimizer state, 16-bit activations, plus the bf16
    weight copies it computes with (all of the stage's under autocast, zero 0; one
    all-gathered block under FSDP's mixed-precision policy).

    ``num_microbatches`` (gradient accumulation steps) caps the micro-batches in flight;
    ``None`` assumes at least ``pp`` of them (the steady state of 1F1B).
    ``sequence_parallel`` defaults to False, as the TP plan (``elastic/parallel/tp.py``) has
    no sequence parallelism; True models a plan that would.
    """
    _check(model_cfg, tp, pp, dp, zero, micro_batch, dtype_bytes, optimizer, pp_schedule)
    model_cfg = memory_inputs(model_cfg)
    if ep > 1 or cp > 1 or model_cfg.experts is not None:  # experts, EP and CP terms: elastic/parallel/memory_moe.py
        from elastic.parallel.memory_moe import estimate_moe_cp

        return estimate_moe_cp(
            estimate_memory, model_cfg, tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, zero=zero, micro_batch=micro_batch,
            activation_checkpointing=activation_checkpointing, dtype_bytes=dtype_bytes, optimizer=optimizer,
            sequence_parallel=sequence_parallel, pp_schedule=pp_schedule, num_microbatches=num_microbatches,
            compute_dtype_bytes=compute_dtype_bytes,
        )  # fmt: skip
    act_bytes = compute_dtype_bytes or dtype_bytes
    mixed = act_bytes < dtype_bytes
    state_bytes = _STATE_BYTES[optimizer] + (4 if dtype_bytes < 4 else 0)
    per_layer = activation_bytes_per_layer(
        model_cfg,
        micro_batch,
        tp,
        recompute=activation_checkpointing,
        sequence_parallel=sequence_parallel,
        dtype_bytes=act_bytes,
    )
    # Full recompute: one layer's activations rebuilt at a time in backward.
    working_set = (
        activation_bytes_per_layer(
            model_cfg,
            micro_batch,
            tp,
            sequence_parallel=sequence_parallel,
            dtype_bytes=act_bytes,
        )
        if activation_checkpointing
        else 0
    )
    layers = layers_per_stage(model_cfg.n_layers, pp)
    micro = num_microbatches if num_microbatches is not None else pp
    block = block_param_count(model_cfg, tp) * dtype_bytes
    worst: MemoryEstimate | None = None
    for stage in range(pp):
        n = stage_param_count(model_cfg, tp, pp, stage)
        params = _ceil(n * dtype_bytes, dp if zero >= 3 else 1)
        grads = _ceil(n * dtype_bytes, dp if zero >= 2 else 1)
        opt = _ceil(n * state_bytes, dp if zero >= 1 else 1)
        buffers = 0
        if dp > 1:
            if zero == 0 and tp == 1 and pp == 1:
                buffers = n * dtype_bytes  # classic DDP: the reducer's buckets copy every gradient
            else:
                buffers = block * (2 if zero >= 2 else 1)  # flat reduction input (+ unsharded grads)
            if zero >= 3:
                root = (n - layers[stage] * block_param_count(model_cfg, tp)) * dtype_bytes
                buffers += block + root - _ceil(root, dp)  # one gathered block; the unsharded root
        if mixed:  # the 16-bit weights computed with
            fsdp = zero >= 1 and dp > 1
            buffers += block_param_count(model_cfg, tp) * act_bytes if fsdp else n * act_bytes
        in_flight = min(pp - stage, micro) if pp_schedule == "1f1b" else micro
        stored = layers[stage] * per_layer * in_flight
        logp = model_cfg.seq_len * micro_batch * model_cfg.vocab_size * 4 if stage == pp - 1 else 0
        held = grads if micro > 1 else 0  # accumulated by earlier micro-batches (none at one)
        phases = [  # (grads, activations, logits) at the candidate peaks of a step
            (held, stored, 3 * logp),  # backward starts: log-probs, their grad and the logits' grad
            (held, stored + working_set, logp),  # recompute: the first layer rebuilt
            (grads, stored - (layers[stage] - 1) * per_layer + working_set, 0),  # backward ends
        ]
        g, acts, logits = max(phases, key=sum)
        total = params + g + opt + buffers + acts + logits
        est = MemoryEstimate(params, g, opt, acts, logits, total, stage, buffers)
        if worst is None or est.total > worst.total:
            worst = est
    assert worst is not None
    return worst


def estimate_for_spec(spec: Any, dp: int, dtype_bytes: int = 4, **kwargs: Any) -> MemoryEstimate:
    """``estimate_memory`` for a ``jobs.JobSpec``-like object (duck-typed) at a DP degree.

    A spec training in bf16 (``train.dtype``, default bf16 on CUDA) gets 16-bit activations
    and weight copies over fp32 state, unless ``compute_dtype_bytes`` is given.
    """
    p = spec.parallel
    train, resources = getattr(spec, "train", None), getattr(spec, "resources", None)
    if "compute_dtype_bytes" not in kwargs and train is not None and hasattr(train, "resolved_dtype"):
        device = getattr(resources, "device", "cpu")
        kwargs["compute_dtype_bytes"] = 2 if train.resolved_dtype(device) == "bf16" else None
    if "num_microbatches" not in kwargs and hasattr(spec, "grad_accum"):
        kwargs["num_microbatches"] = max(1, spec.grad_accum(dp))
    kwargs.setdefault("pp_schedule", getattr(p, "pp_schedule", "1f1b"))
    kwargs.setdefault("ep", getattr(p, "ep", 1))
    kwargs.setdefault("cp", getattr(p, "cp", 1))
    return estimate_memory(
        spec.model,
        tp=p.tp,
        pp=p.pp,
        dp=dp,
        zero=p.zero,
        micro_batch=p.micro_batch,
        activation_checkpointing=p.activation_checkpointing,
        dtype_bytes=dtype_bytes,
        **kwargs,
    )


def _check(cfg, tp, pp, dp, zero, micro_batch, dtype_bytes, optimizer, pp_schedule) -> None:
    for name, value in (("parallel.tp", tp), ("parallel.pp", pp), ("dp", dp), ("parallel.micro_batch", micro_batch)):
        if value < 1:
            raise SpecError(name, f"must be >= 1, got {value}")
    n_layers = memory_inputs(cfg).n_layers
    if pp > n_layers:
        raise SpecError("parallel.pp", f"{pp} stages for {n_layers} layers")
    if zero not in (0, 1, 2, 3):
        raise SpecError("parallel.zero", f"must be 0, 1, 2 or 3, got {zero}")
    if dtype_bytes not in (2, 4):
        raise SpecError("dtype_bytes", f"must be 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes}")
    if optimizer not in _STATE_BYTES:
        raise SpecError("optimizer", f"must be one of {sorted(_STATE_BYTES)}, got {optimizer!r}")
    if pp_schedule not in ("1f1b", "gpipe"):
        raise SpecError("parallel.pp_schedule", f"must be '1f1b' or 'gpipe', got {pp_schedule!r}")


def _ceil(num: int, den: int) -> int:
    return -(-num // den)
