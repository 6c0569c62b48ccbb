"""The ``model`` section of a job spec, one pydantic class per ``model.kind`` (torch-free).

``gpt`` (the reference GPT), ``llama`` (Llama 3 family) and ``custom`` (a user factory).
Each config also knows, by pure arithmetic, what the memory model needs
(``memory_inputs``) and its training FLOPs per token, so ``elastic plan``, the sweep and
the memory model can reason about a 70B model without building it. See docs/models.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, model_validator

from elastic.errors import SpecError
from elastic.models.llama_sizes import LLAMA_SIZES
from elastic.models.rope_scaling import RopeScaling
from elastic.protocols.memory import ExpertMemory, LayerActivations, MemoryInputs

# The Hugging Face model_types ``model.init_from`` loads and an export writes (hf_families.py).
HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
INIT_FROM_HELP = "a Hugging Face model directory (config.json + *.safetensors), local path or fsspec URI"


class GPTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["gpt"] = "gpt"
    n_layers: int = Field(4, ge=1)
    d_model: int = Field(128, ge=8)
    n_heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=2)
    seq_len: int = Field(64, ge=2)
    tie_embeddings: bool = False
    mlp_ratio: int = Field(4, ge=1)
    init_from: str | None = Field(None, description=INIT_FROM_HELP + "; kind: llama only")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def check(self) -> None:
        if self.init_from is not None:
            raise SpecError(
                "model.init_from",
                "kind gpt has no Hugging Face weight mapping: Hugging Face Llama models load as kind: llama",
            )
        if self.d_model % self.n_heads:
            raise SpecError("model.n_heads", f"{self.n_heads} does not divide model.d_model ({self.d_model})")

    def validate_layout(self, tp: int, pp: int, ep: int = 1, cp: int = 1) -> None:
        if ep > 1:
            raise SpecError(
                "parallel.ep", "model.kind gpt has no experts; expert parallelism needs llama with model.moe"
            )
        if cp > 1:
            raise SpecError("parallel.cp", "model.kind gpt has no context-parallel attention; use model.kind llama")
        if self.n_heads % tp:
            raise SpecError("parallel.tp", f"{tp} does not divide model.n_heads ({self.n_heads})")
        if self.d_model % tp:
            raise SpecError("parallel.tp", f"{tp} does not divide model.d_model ({self.d_model})")
        if self.n_layers % pp:
            raise SpecError("parallel.pp", f"{pp} does not divide model.n_layers ({self.n_layers})")
        if pp > 1 and self.tie_embeddings:
            raise SpecError(
                "model.tie_embeddings",
                "tied embeddings need parallel.pp=1 (embedding and head sit on different stages)",
            )

    def memory_inputs(self) -> MemoryInputs:
        d, r, V = self.d_model, self.mlp_ratio, self.vocab_size
        tied = self.tie_embeddings  # a tied table is replicated under TP (the plan shards untied ones only)
        return MemoryInputs(
            n_layers=self.n_layers,
            d_model=d,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            vocab_size=V,
            block_split=(4 + 2 * r) * d * d,
            block_whole=4 * d,  # two LayerNorms (weight + bias)
            first_split=0 if tied else V * d,
            first_whole=self.seq_len * d + (V * d if tied else 0),
            last_split=0 if tied else V * d,
            last_whole=2 * d,
            act_scores=0,  # fused attention (scaled_dot_product_attention): no stored softmax
            vocab_parallel=not tied,
            embedding_grad_whole=True,
            head_params=V * d,
            # Bytes per token and d_model unit, counted from the ops and measured with the
            # live-tensor tracker (docs/sweep.md). Whole: each LayerNorm's input and output
            # (under autocast the output's 16-bit copy for each linear instead). Split: q, k,
            # v, the attention output, the MLP's two hidden states (r d wide).
            act_fp32=LayerActivations(whole=16, split=16 + 8 * r, residual=4, head=8, backward=8 * r),
            act_autocast=LayerActivations(whole=16, split=8 + 4 * r, residual=4, head=6, backward=4 * r),
            act_bf16=LayerActivations(whole=8, split=8 + 4 * r, residual=2, head=4, backward=4 * r),
        )

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), 6N + 12·L·d·T as in PaLM's MFU."""
        d, L, T = self.d_model, self.n_layers, self.seq_len
        per_layer = 4 * d * d + 2 * self.mlp_ratio * d * d
        n = L * per_layer + self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return 6.0 * n + 12.0 * L * d * T


class MoEConfig(BaseModel):
    """``model.moe``: every Llama block's MLP becomes a top-k routed mixture of SwiGLU experts.

    Routing is dropless (no capacity factor: every token reaches its ``top_k`` experts), so
    a token's output never depends on which other tokens share its micro-batch, and the
    load-balancing loss is computed per sequence: the model is the same function under
    every micro-batch size and parallel layout (docs/models.md).
    """

    model_config = ConfigDict(extra="forbid")

    n_experts: int = Field(..., ge=1, description="routed experts per layer (parallel.ep must divide it)")
    top_k: int = Field(..., ge=1, description="experts each token is routed to")
    expert_hidden: int | None = Field(
        None, ge=1, description="SwiGLU hidden size of one expert; default the dense MLP's"
    )
    shared_expert: bool = Field(False, description="add one always-used SwiGLU expert of the same size")
    router: Literal["softmax", "sigmoid"] = Field("softmax", description="how router logits become scores")
    norm_topk_prob: bool = Field(False, description="rescale each token's top_k weights to sum to 1")
    aux_loss_coef: float = Field(0.01, ge=0, description="weight of the per-sequence load-balancing loss")

    def check(self) -> None:
        if self.top_k > self.n_experts:
            raise SpecError("model.moe.top_k", f"{self.top_k} is more than model.moe.n_experts ({self.n_experts})")


class LlamaConfig(BaseModel):
    """Llama 3 family: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention;
    with ``moe``, a routed mixture of experts in place of the MLP."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["llama"] = "llama"
    size: Literal[tuple(LLAMA_SIZES)] | None = Field(  # type: ignore[valid-type]
        None, description="a named shape (docs/models.md); the other keys override it"
    )
    init_from: str | None = Field(None, description=INIT_FROM_HELP + "; its config.json gives the shape")
    n_layers: int = Field(4, ge=1)
    d_model: int = Field(256, ge=8)
    n_heads: int = Field(8, ge=1)
    n_kv_heads: int | None = Field(None, ge=1, description="key/value heads (GQA); default n_heads")
    head_dim: int | None = Field(
        None, ge=2, description="the size of one attention head; default d_model / n_heads (Qwen3 sets its own)"
    )
    vocab_size: int = Field(2048, ge=2)
    seq_len: int = Field(128, ge=2)
    multiple_of: int = Field(256, ge=1, description="SwiGLU hidden size is rounded up to a multiple of this")
    ffn_dim_multiplier: float | None = Field(None, gt=0)
    ffn_dim: int | None = Field(None, ge=1, description="SwiGLU hidden size; default from multiple_of")
    rope_theta: float = Field(500_000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = Field(False, description="the output head shares the embedding's weight")
    max_seq_len: int | None = Field(None, ge=2, description="the published context length (metadata)")
    moe: MoEConfig | None = Field(None, description="a routed mixture of experts in place of the MLP")
    qkv_bias: bool = Field(False, description="biases on the q, k and v projections (Qwen2)")
    qk_norm: bool = Field(False, description="RMSNorm over each head of q and k before RoPE (Qwen3)")
    family: Literal[HF_FAMILIES] | None = Field(  # type: ignore[valid-type]
        None, description="the Hugging Face model_type an export writes; default: the one the architecture is"
    )
    sliding_window: int | None = Field(
        None, ge=2, description="Mistral's attention window (metadata: attention here spans seq_len, at most it)"
    )
    bos_token_id: int | None = Field(None, description="metadata for an export: from init_from's config.json")
    eos_token_id: int | list[int] | None = Field(None, description="metadata for an export, as bos_token_id")

    @model_validator(mode="before")
    @classmethod
    def _apply_size(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("size") in LLAMA_SIZES:  # an unknown one fails on the field
            data = {**LLAMA_SIZES[data["size"]], **data}
        return data

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """The size of one attention head: ``head_dim``, else ``d_model / n_heads``."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def attn_dim(self) -> int:
        """The width of the query heads together (``d_model`` unless ``head_dim`` is set)."""
        return self.n_heads * self.head_size

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size: ``ffn_dim``, else as Meta's reference code computes it (14336 for 8B)."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * 4 * self.d_model / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def check(self) -> None:
        if self.init_from is not None:  # reads config.json only: the shape, checked against the keys given
            from elastic.models.hf import apply_hf_config

            apply_hf_config(self, MoEConfig)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise SpecError("model.n_heads", f"{self.n_heads} does not divide model.d_model ({self.d_model})")
        if self.head_size % 2:
            field = "model.head_dim" if self.head_dim else "model.n_heads"
            raise SpecError(field, f"the head size {self.head_size} must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise SpecError("model.n_kv_heads", f"{self.kv_heads} does not divide model.n_heads ({self.n_heads})")
        if self.rope_scaling is not None:
            self.rope_scaling.check()
        if self.moe is not None:
            self.moe.check()
        if self.sliding_window is not None and self.sliding_window < self.seq_len:
            raise SpecError(
                "model.sliding_window",
                f"{self.sliding_window} is shorter than model.seq_len ({self.seq_len}): sliding-window attention "
                "is not implemented",
            )
        if self.family is not None:  # a model of that family, or an export would write another model
            from elastic.models.hf_families import family_of

            family_of(self)

    @property
    def expert_hidden(self) -> int:
        return (self.moe.expert_hidden if self.moe is not None else None) or self.hidden_dim

    def validate_layout(self, tp: int, pp: int, ep: int = 1, cp: int = 1) -> None:
        if tp > self.kv_heads or self.kv_heads % tp:
            raise SpecError(
                "parallel.tp",
                f"{tp} must divide model.n_kv_heads ({self.kv_heads}): each TP rank needs whole key/value heads",
            )
        if self.n_heads % tp:
            raise SpecError("parallel.tp", f"{tp} does not divide model.n_heads ({self.n_heads})")
        if self.hidden_dim % tp:
            raise SpecError("parallel.tp", f"{tp} does not divide the SwiGLU hidden size ({self.hidden_dim})")
        if self.n_layers % pp:
            raise SpecError("parallel.pp", f"{pp} does not divide model.n_layers ({self.n_layers})")
        if pp > 1 and self.tie_embeddings:
            raise SpecError(
                "model.tie_embeddings",
                "tied embeddings need parallel.pp=1 (embedding and head sit on different stages)",
            )
        self._validate_ep_cp(tp, ep, cp)

    def _validate_ep_cp(self, tp: int, ep: int, cp: int) -> None:
        moe = self.moe
        if ep > 1 and moe is None:
            raise SpecError("parallel.ep", f"expert parallelism ({ep}) needs a mixture of experts (model.moe)")
        if moe is not None and moe.n_experts % ep:
            raise SpecError("parallel.ep", f"{ep} does not divide model.moe.n_experts ({moe.n_experts})")
        if moe is not None and self.expert_hidden % tp:
            raise SpecError("parallel.tp", f"{tp} does not divide the expert hidden size ({self.expert_hidden})")
        if self.seq_len % cp:
            raise SpecError("parallel.cp", f"{cp} does not split model.seq_len ({self.seq_len}) into equal chunks")

    def block_params(self) -> int:
        """A block's parameters that tensor parallelism splits (the norms stay whole)."""
        d, q, kv = self.d_model, self.attn_dim, self.kv_heads * self.head_size
        attn = 2 * d * q + 2 * d * kv + ((q + 2 * kv) if self.qkv_bias else 0)
        if self.moe is None:
            return attn + 3 * d * self.hidden_dim
        return attn + self.moe_block_params()

    def moe_config(self) -> MoEConfig:
        """``moe``, for the code of a mixture-of-experts model (calling it on a dense one is a bug)."""
        if self.moe is None:
            raise RuntimeError("model.moe is not set: a dense Llama has no experts")
        return self.moe

    def moe_block_params(self, active: bool = False) -> int:
        """The MoE layer's parameters: router, experts (only ``top_k`` of them if ``active``), shared expert."""
        moe, d = self.moe_config(), self.d_model
        experts = moe.top_k if active else moe.n_experts
        return d * moe.n_experts + (experts + int(moe.shared_expert)) * 3 * d * self.expert_hidden

    def memory_inputs(self) -> MemoryInputs:
        if self.moe is not None:
            return self._moe_memory_inputs(self.kv_heads / self.n_heads)
        d, V = self.d_model, self.vocab_size
        r = self.hidden_dim / d
        tied = self.tie_embeddings  # a tied table is replicated under TP (the plan shards untied ones only)
        return MemoryInputs(
            n_layers=self.n_layers,
            d_model=d,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            vocab_size=V,
            block_split=self.block_params(),
            block_whole=2 * d + 2 * self.head_size * int(self.qk_norm),  # RMSNorm weights
            first_split=0 if tied else V * d,
            first_whole=V * d if tied else 0,
            last_split=0 if tied else V * d,
            last_whole=d,
            act_scores=0,  # fused attention (scaled_dot_product_attention): no stored softmax
            vocab_parallel=not tied,
            embedding_grad_whole=True,
            head_params=V * d,
            # Bytes per token and d_model unit, counted from the ops and measured with the
            # live-tensor tracker (docs/sweep.md). Whole: each RMSNorm's input, normalised
            # value and output (fp32 inside the norm), the output's copies for the linears.
            # Split: rotated q, k and v repeated to every query head, the attention output
            # and its copy into the o-projection's input, the SwiGLU's four hidden states.
            act_fp32=LayerActivations(whole=24, split=20 + 16 * r, residual=4, head=12, backward=12 * r),
            act_autocast=LayerActivations(whole=26, split=10 + 8 * r, residual=4, head=10, backward=6 * r),
            act_bf16=LayerActivations(whole=20, split=10 + 8 * r, residual=2, head=10, backward=6 * r),
        )

    def _moe_memory_inputs(self, kv_frac: float) -> MemoryInputs:
        """As the dense model's, with the MLP's activations those of the routed experts
        (elastic/parallel/memory_moe.py): kept whole under TP, the router's scores and the
        ``top_k`` token copies in and out of the experts; split, the experts' (and the
        shared expert's) four SwiGLU intermediates per copy."""
        moe, d, he, V = self.moe_config(), self.d_model, self.expert_hidden, self.vocab_size
        tied = self.tie_embeddings
        q, kv = self.attn_dim, self.kv_heads * self.head_size
        dense = 2 * d * q + 2 * d * kv + ((q + 2 * kv) if self.qkv_bias else 0)
        experts = ExpertMemory(moe.n_experts, d, he)
        return MemoryInputs(
            n_layers=self.n_layers,
            d_model=d,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            vocab_size=V,
            block_split=dense + int(moe.shared_expert) * 3 * d * he + experts.params,
            # norms (Qwen3's q/k norms too) and the router, replicated over TP
            block_whole=2 * d + 2 * self.head_size * int(self.qk_norm) + d * moe.n_experts,
            first_split=0 if tied else V * d,
            first_whole=V * d if tied else 0,
            last_split=0 if tied else V * d,
            last_whole=d,
            vocab_parallel=not tied,  # the dense model's TP plan for the embedding and head
            embedding_grad_whole=True,
            head_params=V * d,
            act_whole=8 + 4 * moe.top_k + 2 * moe.n_experts / d,
            act_split=6 + 6 * kv_frac + 8 * he * (moe.top_k + int(moe.shared_expert)) / d,
            act_scores=0,
            experts=experts,
        )

    def flops_per_token(self) -> float:
        """6N (weights, embeddings counted once as in torchtitan) + 12·L·d·T attention;
        with experts N counts the active ones (``top_k`` of them) only."""
        block = self.block_params()
        if self.moe is not None:
            block += self.moe_block_params(active=True) - self.moe_block_params()
        n = self.n_layers * block + self.vocab_size * self.d_model
        return 6.0 * n + 12.0 * self.n_layers * self.attn_dim * self.seq_len


class CustomConfig(BaseModel):
    """A user's model: ``factory`` is ``package.module:function``, called with ``args``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["custom"] = "custom"
    factory: str = Field(..., min_length=3, description="package.module:function returning an elastic ModelSpec")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the factory")
    vocab_size: int | None = Field(None, ge=2, description="default: the factory's ModelSpec.vocab_size")
    seq_len: int | None = Field(None, ge=2, description="default: the factory's ModelSpec.seq_len")
    init_from: str | None = Field(None, description=INIT_FROM_HELP + "; needs the factory's ModelSpec.hf")
    _import_root: str | None = PrivateAttr(None)  # where the driver found the module (see custom.py)

    def check(self) -> None:
        """Import and call the factory (exit 2 naming ``model.factory`` if that fails)."""
        from elastic.models.custom import load_spec

        spec = load_spec(self)
        self.vocab_size = self.vocab_size or spec.vocab_size
        self.seq_len = self.seq_len or spec.seq_len
        if self.init_from is not None:
            from elastic.models.hf import check_custom_init_from

            check_custom_init_from(self, spec)

    def validate_layout(self, tp: int, pp: int, ep: int = 1, cp: int = 1) -> None:
        from elastic.models.custom import load_spec

        load_spec(self).check_layout(tp, pp, ep, cp)

    def memory_inputs(self) -> MemoryInputs:
        from elastic.models.custom import load_spec

        inputs = load_spec(self).memory
        if inputs is None:
            raise SpecError("model.factory", f"{self.factory} gives no memory-model inputs (ModelSpec.memory)")
        return inputs

    def flops_per_token(self) -> float:
        from elastic.models.custom import load_spec

        return load_spec(self).flops_per_token


def token_shape(model: GPTConfig | LlamaConfig | CustomConfig) -> tuple[int, int]:
    """``(seq_len, vocab_size)`` of a checked model config. A custom model's are filled in from
    its factory by ``check()``, which every spec passes before a run or a command uses it."""
    if model.seq_len is None or model.vocab_size is None:
        raise RuntimeError(f"model {model.kind}: seq_len and vocab_size are set by check(), which has not run")
    return model.seq_len, model.vocab_size


def _kind_of(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("kind", "gpt")
    return getattr(value, "kind", "gpt")


# The type of ``JobSpec.model``: the kind picks the class; no kind means gpt.
AnyModelConfig = Annotated[
    Annotated[GPTConfig, Tag("gpt")] | Annotated[LlamaConfig, Tag("llama")] | Annotated[CustomConfig, Tag("custom")],
    Discriminator(_kind_of, custom_error_type="model_kind", custom_error_message="must be gpt, llama or custom"),
]
MODEL_KINDS = ("gpt", "llama", "custom")
