"""Analytical per-rank memory of a training step (any ``model.kind``), in bytes.

Runs wherever a spec is checked (driver, ``elastic plan``, the sweep's pruning): pure
arithmetic, no torch. A model describes itself through ``MemoryInputs`` (its parameters per
block and per first/last stage, its activation bytes per layer at each precision); the
terms are in ``memory_terms.py``, and docs/sweep.md ("How the memory model counts") gives
the whole account with the measurements behind each term.

What the estimate follows, from the engine (``elastic/parallel/``):

* **precision**: fp32 (``train.dtype: fp32``, the CPU default); ``autocast`` (bf16 with
  ZeRO 0: fp32 weights and optimizer state, a cached bf16 copy of every linear weight, the
  residual stream in fp32); ``bf16`` (FSDP2's bf16 parameter policy with ZeRO >= 1, or
  ``dtype_bytes=2``: everything 16-bit but the loss);
* **tensor parallelism**: linears split ``tp`` ways; the embedding, the head and the
  logits split only where the model's plan shards them by vocabulary
  (``MemoryInputs.vocab_parallel``: the built-in models when ``tp`` divides the vocabulary
  and the embeddings are untied). There is no sequence parallelism in the TP plan, so the
  model has none either (docs/sweep.md says why);
* **pipeline parallelism**: 1F1B keeps ``pp - stage`` micro-batches in flight on a stage
  (GPipe all of them), and ``PipelineStage`` keeps one receive buffer per micro-batch of
  the step; the worst stage is reported;
* **ZeRO** through FSDP2 (sharded storage, unsharded compute copies), classic DDP or
  ``replicate`` as ``parallelize.py`` picks them;
* the peak is the largest of three moments of a step: backward starts, the first layer
  recomputed, backward ends.

Experts and expert and context parallelism go through ``memory_moe.py`` (the dense part
through these terms, theirs added). Any model kind can add terms of its own through
``MemoryInputs.extra_terms``: a function of the ``StageContext`` returning ``ExtraTerms``,
added to the stage before its peak is taken.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from elastic.errors import SpecError
from elastic.optim import state_bytes_name
from elastic.parallel.memory_terms import STATE_BYTES, ceil_div, layers_per_stage, stage_estimate, stage_params

# The input types live below models/ and parallel/ (``elastic/protocols/memory.py``); named here
# too, where a model's factory has always imported them from.
from elastic.protocols.memory import ExtraTerms, LayerActivations, MemoryInputs, StageContext  # noqa: F401


def memory_inputs(cfg: Any) -> MemoryInputs:
    """``cfg`` itself if it is ``MemoryInputs``, else what the model config derives."""
    if isinstance(cfg, MemoryInputs):
        return cfg
    if hasattr(cfg, "memory_inputs"):
        return cfg.memory_inputs()
    raise SpecError("model", f"no memory-model inputs for {type(cfg).__name__}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank on the worst pipeline stage (``stage``), at its peak moment."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    total: int
    stage: int = 0
    buffers: int = 0
    pipeline: int = 0

    def fits(self, capacity_bytes: float, headroom: float = 0.9) -> bool:
        """True if ``total`` stays under ``headroom`` of the device memory."""
        return self.total <= capacity_bytes * headroom

    def __str__(self) -> str:
        gib = 1 << 30
        fields = ("params", "grads", "optimizer", "buffers", "pipeline", "activations", "logits")
        parts = ", ".join(f"{k}={getattr(self, k) / gib:.3f}" for k in fields)
        return f"{self.total / gib:.3f} GiB (stage {self.stage}: {parts})"


def stage_param_count(cfg: Any, tp: int, pp: int, stage: int) -> int:
    """Parameters held by one rank of ``stage`` (split by TP, not by ZeRO)."""
    m = memory_inputs(cfg)
    ctx = _context(m, tp=tp, pp=pp, dp=1, zero=0, stage=stage, micro_batch=1, microbatches=1)
    return stage_params(m, ctx)[0]


def block_param_count(cfg: Any, tp: int = 1) -> int:
    """Parameters of one transformer block on one rank (linears split by TP, norms whole)."""
    m = memory_inputs(cfg)
    return ceil_div(m.block_split, tp) + m.block_whole


def total_param_count(cfg: Any) -> int:
    """All parameters of the unsplit model (equals the built model's parameter count)."""
    return stage_param_count(cfg, 1, 1, 0)


def activation_bytes_per_layer(
    cfg: Any, micro_batch: int, tp: int = 1, *, recompute: bool = False, precision: str = "fp32"
) -> int:
    """Stored activations of one transformer layer for one micro-batch on one rank."""
    m = memory_inputs(cfg)
    compute = 4 if precision == "fp32" else 2
    acts = m.activations(precision, compute, 4)
    tokens = micro_batch * m.seq_len
    if recompute:
        return ceil_div(tokens * m.d_model * acts.residual, 1)
    scores = m.act_scores * m.n_heads * m.seq_len * tokens * compute / 2
    return ceil_div(tokens * m.d_model * (acts.whole + acts.split / tp) + scores / tp, 1)


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
    pp_schedule: str = "1f1b",
    num_microbatches: int | None = None,
    compute_dtype_bytes: int | None = None,
    ep: int = 1,
    cp: int = 1,
    shard_group: int | None = None,
) -> MemoryEstimate:
    """Per-rank memory of the worst pipeline stage; see the module doc for the model.

    ``dtype_bytes``: the stored parameters (4: the engine's fp32 master weights).
    ``compute_dtype_bytes=2`` is the engine's ``train.dtype: bf16``: autocast with ZeRO 0,
    FSDP2's bf16 policy with ZeRO >= 1. ``num_microbatches`` (gradient accumulation
    steps, the pipeline's micro-batches): ``None`` assumes ``pp`` of them. ``ep``, ``cp``
    and a model with experts: ``memory_moe.estimate_moe_cp``. ``shard_group`` (HSDP, not
    with EP or CP): ZeRO divides the sharded state by the group instead of ``dp``.
    """
    _check(model_cfg, tp, pp, dp, zero, micro_batch, dtype_bytes, optimizer, pp_schedule)
    m = memory_inputs(model_cfg)
    if ep > 1 or cp > 1 or m.experts is not None:  # experts, EP and CP terms: elastic/parallel/memory_moe.py
        from elastic.parallel.memory_moe import estimate_moe_cp

        return estimate_moe_cp(
            estimate_memory, m, tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, zero=zero, micro_batch=micro_batch,
            activation_checkpointing=activation_checkpointing, dtype_bytes=dtype_bytes, optimizer=optimizer,
            pp_schedule=pp_schedule, num_microbatches=num_microbatches, compute_dtype_bytes=compute_dtype_bytes,
        )  # fmt: skip
    worst: MemoryEstimate | None = None
    for stage in range(pp):
        ctx = _context(
            m,
            tp=tp,
            pp=pp,
            dp=dp,
            zero=zero,
            stage=stage,
            micro_batch=micro_batch,
            microbatches=num_microbatches if num_microbatches is not None else pp,
            recompute=activation_checkpointing,
            dtype_bytes=dtype_bytes,
            compute_dtype_bytes=compute_dtype_bytes,
            optimizer=optimizer,
            schedule=pp_schedule,
        )
        if shard_group is not None:
            ctx = replace(ctx, shard_group=shard_group)
        if m.extra_terms is not None:
            ctx = replace(ctx, extra=m.extra_terms(ctx))
        acts = m.activations(ctx.precision, ctx.compute_bytes, ctx.param_bytes)
        t = stage_estimate(m, ctx, acts)
        est = MemoryEstimate(
            t.params, t.grads, t.optimizer, t.activations, t.logits, t.total, stage, t.buffers, t.pipeline
        )
        if worst is None or est.total > worst.total:
            worst = est
    assert worst is not None
    return worst


def _context(
    m: MemoryInputs,
    *,
    tp: int,
    pp: int,
    dp: int,
    zero: int,
    stage: int,
    micro_batch: int,
    microbatches: int,
    recompute: bool = False,
    dtype_bytes: int = 4,
    compute_dtype_bytes: int | None = None,
    optimizer: str = "adamw",
    schedule: str = "1f1b",
) -> StageContext:
    compute = compute_dtype_bytes or dtype_bytes
    if dtype_bytes < 4 or (compute < dtype_bytes and zero >= 1):
        precision = "bf16"
    else:
        precision = "autocast" if compute < dtype_bytes else "fp32"
    # parallelize.py: FSDP2 with zero >= 1 across DP ranks, and with bf16 even at dp 1.
    fsdp = zero >= 1 and (dp > 1 or compute < dtype_bytes)
    # 1F1B: stage i holds at most pp - i micro-batches; torch falls back to GPipe (all of
    # them) when there are fewer micro-batches than stages.
    one_f_one_b = schedule == "1f1b" and microbatches >= pp
    in_flight = min(pp - stage, microbatches) if one_f_one_b else microbatches
    return StageContext(
        tp=tp,
        pp=pp,
        dp=dp,
        zero=zero,
        stage=stage,
        layers=layers_per_stage(m.n_layers, pp)[stage],
        micro_batch=micro_batch,
        tokens=micro_batch * m.seq_len,
        microbatches=microbatches,
        in_flight=in_flight if pp > 1 else 1,
        recompute=recompute,
        precision=precision,
        param_bytes=dtype_bytes,
        compute_bytes=compute,
        fsdp=fsdp,
        optimizer=optimizer,
    )


def estimate_for_spec(spec: Any, dp: int, dtype_bytes: int = 4, **kwargs: Any) -> MemoryEstimate:
    """``estimate_memory`` for a ``jobs.JobSpec``-like object (duck-typed) at a DP degree.

    A spec training in bf16 (``train.dtype``, default bf16 on CUDA) computes in 16 bits
    over fp32 state, unless ``compute_dtype_bytes`` is given.
    """
    p = spec.parallel
    train, resources = getattr(spec, "train", None), getattr(spec, "resources", None)
    if "compute_dtype_bytes" not in kwargs and train is not None and hasattr(train, "resolved_dtype"):
        device = getattr(resources, "device", "cpu")
        kwargs["compute_dtype_bytes"] = 2 if train.resolved_dtype(device) == "bf16" else None
    if "num_microbatches" not in kwargs and hasattr(spec, "grad_accum"):
        kwargs["num_microbatches"] = max(1, spec.grad_accum(dp))
    if "optimizer" not in kwargs and train is not None and hasattr(train, "optimizer"):
        kwargs["optimizer"] = state_bytes_name(train)  # train.optimizer: SGD keeps 0 or 4 bytes
    kwargs.setdefault("pp_schedule", getattr(p, "pp_schedule", "1f1b"))
    kwargs.setdefault("ep", getattr(p, "ep", 1))
    kwargs.setdefault("cp", getattr(p, "cp", 1))
    kwargs.setdefault("shard_group", getattr(p, "shard_group", None))
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
    if optimizer not in STATE_BYTES:
        raise SpecError("optimizer", f"must be one of {sorted(STATE_BYTES)}, got {optimizer!r}")
    if pp_schedule not in ("1f1b", "gpipe"):
        raise SpecError("parallel.pp_schedule", f"must be '1f1b' or 'gpipe', got {pp_schedule!r}")
