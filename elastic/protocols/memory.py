"""What a model tells the memory model about itself: the input types of
``elastic.parallel.memory_model`` (pure data, no torch).

A model config derives its ``MemoryInputs`` (``elastic/models/config.py``) and a user's
``ModelSpec.memory`` carries one; the memory model (``elastic/parallel/memory_model.py``,
its terms in ``memory_terms.py`` and ``memory_moe.py``) reads them. They live below both
packages so that neither imports the other for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LayerActivations:
    """Stored bytes of one layer at one precision, per token and per ``d_model`` unit.

    ``whole``: kept whole under TP (norm inputs and outputs, the linears' inputs); ``split``:
    divided by TP (attention heads, MLP hidden states); ``residual``: bytes per element of
    the residual stream (what recompute keeps per layer and a pipeline stage sends);
    ``head``: what the last stage stores before the loss (final norm, the head's input).
    ``backward``: the gradients of activations alive at once while one layer's backward
    runs (the MLP's hidden states; split by TP).
    """

    whole: float
    split: float
    residual: float
    head: float = 0.0
    backward: float = 0.0


@dataclass(frozen=True)
class ExtraTerms:
    """Terms a model kind adds to a stage (``MemoryInputs.extra_terms``); may be negative.

    ``param_count``: parameters on this rank beyond the dense blocks (after its own
    splits); they get gradients, optimizer state and sharding like the others.
    ``activation_bytes``: stored per micro-batch in flight. ``buffer_bytes``: held through
    the step.
    """

    param_count: int = 0
    activation_bytes: int = 0
    buffer_bytes: int = 0


@dataclass(frozen=True)
class StageContext:
    """One pipeline stage of one layout, as every term sees it."""

    tp: int
    pp: int
    dp: int
    zero: int
    stage: int
    layers: int
    micro_batch: int
    tokens: int  # per micro-batch on this rank: micro_batch * seq_len
    microbatches: int  # per step (gradient accumulation; the pipeline's micro-batches)
    in_flight: int  # micro-batches whose activations the stage holds at once
    recompute: bool
    precision: str  # fp32, autocast or bf16
    param_bytes: int  # stored parameters and gradients (4; 2 for dtype_bytes=2)
    compute_bytes: int  # activations and the weights computed with
    fsdp: bool  # FSDP2 holds the parameters (zero >= 1 with dp > 1, or with bf16)
    optimizer: str = "adamw"
    shard_group: int | None = None  # HSDP (parallel.shard_group): ZeRO divides by it, not by dp
    extra: ExtraTerms = ExtraTerms()


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory model needs to know about a model (per unsplit block or stage).

    ``*_split`` parameters are divided by TP, ``*_whole`` ones replicated. With
    ``vocab_parallel`` the ``first_split``/``last_split`` parameters (the embedding and the
    head) and the logits are split only where ``tp`` divides ``vocab_size`` (the built-in
    plans), else kept whole; without it the ``*_split`` parameters are always split and the
    logits never. ``embedding_grad_whole``: the embedding's gradient is full-size on every
    TP rank even where its table is split (torch's DTensor embedding backward, which the
    built-in plans use, returns a replicated gradient). ``head_params``: the last stage's
    parameters that the head multiplies with (cast to 16 bits under autocast); default
    ``last_split``.

    Activations: ``act_fp32``, ``act_autocast``, ``act_bf16`` give one layer's stored bytes
    at each precision (``LayerActivations``). A model that gives none is counted with
    Korthikanti et al.'s per-``s*b*h`` coefficients at 16 bits (``act_whole``,
    ``act_split``; the GPT of the paper's 10 and 24) scaled to the precision.
    ``act_scores``: bytes per ``a*s^2*b`` at 16 bits for attention that stores its softmax
    (the paper's 5), 0 for a fused kernel (``scaled_dot_product_attention``).
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
    vocab_parallel: bool = False
    embedding_grad_whole: bool = False
    head_params: int | None = None
    act_fp32: LayerActivations | None = None
    act_autocast: LayerActivations | None = None
    act_bf16: LayerActivations | None = None
    extra_terms: Callable[[StageContext], ExtraTerms] | None = field(default=None, compare=False)
    experts: Any = None  # a MoE model's routed experts: elastic.parallel.memory_moe.ExpertMemory

    def activations(self, precision: str, compute_bytes: int, param_bytes: int) -> LayerActivations:
        """The per-layer bytes at ``precision`` (declared, or Korthikanti's scaled)."""
        declared = {"fp32": self.act_fp32, "autocast": self.act_autocast, "bf16": self.act_bf16}[precision]
        if declared is not None:
            return declared
        scale = compute_bytes / 2
        residual = param_bytes if precision == "autocast" else compute_bytes
        return LayerActivations(self.act_whole * scale, self.act_split * scale, residual)


@dataclass(frozen=True)
class ExpertMemory:
    """What the memory model needs to know about one layer's routed experts (unsplit)."""

    n_experts: int
    d_model: int
    expert_hidden: int

    @property
    def params(self) -> int:
        """All routed experts of one layer: three ``d x h`` matrices each."""
        return self.n_experts * 3 * self.d_model * self.expert_hidden
