"""``model.kind: llama``: the Llama 3 architecture, written for this engine.

RMSNorm (in fp32), rotary position embeddings (RoPE, Su et al. 2021), a SwiGLU MLP
(``w2(silu(w1 x) * w3 x)``, Shazeer 2020) and grouped-query attention (``n_kv_heads``
key/value heads shared by ``n_heads / n_kv_heads`` query heads each, Ainslie et al. 2023).
Shapes follow Meta's reference code, so ``size: llama3-8b`` has 8.03e9 parameters. Llama 3.1
and later add a RoPE frequency scaling (``model.rope_scaling``, ``llama3_scaled``); Llama 3.2
1B/3B tie the head to the embedding (``tie_embeddings``). ``elastic.models.hf_families`` maps
the model to and from Hugging Face's ``LlamaForCausalLM`` and its kin (``ModelSpec.hf``).

The layout rules of the reference GPT hold: blocks in a ``ModuleDict`` keyed by layer
index (a pipeline stage keeps its FQNs), separate ``wq/wk/wv/wo`` and ``w1/w2/w3``
linears (the TP plan is column/row-wise over named submodules), a forward that tolerates
a missing embedding or head, and per-FQN seeded init. The rotary tables are computed in
the forward from positions (no buffers: the engine's state is parameters only).

TP plan: ``wq``, ``wk``, ``wv`` column-wise (each TP rank owns ``n_heads / tp`` query and
``n_kv_heads / tp`` key/value heads, so ``tp`` must divide ``n_kv_heads``; Qwen2's biases
split with their rows, Qwen3's q/k norm weights replicated), ``wo`` row-wise; ``w1`` and
``w3`` column-wise, ``w2`` row-wise; the embedding vocab-parallel and the head's logits
sharded for ``loss_parallel`` when ``tp`` divides the vocabulary and the two are not tied.

The Hugging Face families (``hf_families.py``) are this model with switches: ``qkv_bias``
(Qwen2), ``qk_norm`` (Qwen3: each head of q and k RMS-normalised before RoPE) and
``head_dim`` (a head size other than ``d_model / n_heads``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from elastic.models.config import LlamaConfig, RopeScaling
from elastic.models.documents import Documents, documents
from elastic.models.hf_families import hf_adapter
from elastic.models.spec import ModelSpec, lm_loss, normal_or_ones, register_model, seeded_init

if TYPE_CHECKING:
    from elastic.parallel.cp import ContextParallel


# The norm weights (initialised to ones): per block, the final one, Qwen3's per-head q/k norms.
NORMS = ("attn_norm.weight", "mlp_norm.weight", "norm.weight", "q_norm.weight", "k_norm.weight")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(
    seq: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    scaling: RopeScaling | None = None,
    start: int = 0,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * theta^(-2i/head_dim)`` for positions ``start .. start + seq - 1``,
    shape ``[seq, head_dim / 2]`` (fp32). ``start`` > 0: a context-parallel chunk. ``positions``
    (``[b, seq]``, packed documents: ``elastic.models.documents``): those instead, shape
    ``[b, 1, seq, head_dim / 2]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    if positions is not None:
        angles = (positions.to(torch.float32)[..., None] * inv_freq)[:, None]
        return angles.cos(), angles.sin()
    pos = torch.arange(start, start + seq, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    return angles.cos(), angles.sin()


def llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling (Meta's ``apply_scaling``): wavelengths longer than the
    pre-training context / ``low_freq_factor`` are stretched by ``factor``, those shorter than
    context / ``high_freq_factor`` kept, and the band between interpolated smoothly."""
    context = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = torch.where(wavelen > context / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    between = (wavelen >= context / s.high_freq_factor) & (wavelen <= context / s.low_freq_factor)
    return torch.where(between, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])`` of ``x`` (``[b, heads, seq, head_dim]``) by the angles."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim, self.theta, self.rope_scaling = cfg.head_size, cfg.rope_theta, cfg.rope_scaling
        self.n_rep = cfg.n_heads // cfg.kv_heads
        kv_dim = cfg.kv_heads * cfg.head_size
        self.wq = nn.Linear(cfg.d_model, cfg.attn_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.attn_dim, cfg.d_model, bias=False)
        # Qwen3: each head of q and k RMS-normalised (one weight per head dimension) before RoPE
        self.q_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.cp: ContextParallel | None = None  # set when the sequence is split over ranks

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        """``docs``: the row's packed documents (block-diagonal causal attention, positions
        restarting at each document); ``None``: one causal sequence."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp (n_kv_heads / tp) of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        start = self.cp.rope_offset(seq) if self.cp is not None else 0
        positions = docs.positions if docs is not None else None
        cos, sin = rope_tables(seq, self.head_dim, self.theta, x.device, self.rope_scaling, start, positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cp is not None:  # this rank's chunk of the sequence attends to all earlier chunks
            if docs is not None:
                raise RuntimeError("document_ids under context parallelism (the preflight refuses it)")
            y = self.cp.attention(q, k, v, self.n_rep)
            return self.wo(y.transpose(1, 2).reshape(bsz, seq, -1))
        if self.n_rep > 1:  # each key/value head serves n_rep consecutive query heads
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        if docs is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), docs)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, block: type[nn.Module] = Block):
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # Llama 3.2 1B/3B; tied again in ``init_weights`` after ``to_empty``
            self.head.weight = self.tok_emb.weight

    def attentions(self) -> list[Attention]:
        """Every block's attention (a ``Block`` or a ``MoEBlock``, each holds one as ``attn``)."""
        return [cast(Attention, block.attn) for block in self.blocks.values()]

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids -> logits on a full model; hidden states in or out on a pipeline stage.
        ``document_ids`` (``[b, s]``): the row is packed from documents that never attend to
        each other, each with positions from 0 (``elastic.models.documents``)."""
        docs = documents(document_ids) if document_ids is not None else None
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        for block in self.blocks.values():
            x = block(x) if docs is None else block(x, docs)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def init_weights(self, seed: int) -> None:
        if self.cfg.tie_embeddings and self.head is not None and self.tok_emb is not None:
            self.head.weight = self.tok_emb.weight  # ``to_empty`` after a meta build unties them
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        seeded_init(self, seed, normal_or_ones(0.02, residual_std, NORMS, ("wo.weight", "w2.weight")))


def build_stage(model: Llama, pp: int, pp_rank: int) -> Llama:
    """Keep stage ``pp_rank`` of ``pp`` in place, keeping FQNs (``pp`` divides the layers)."""
    per_stage = model.cfg.n_layers // pp
    owned = {str(i) for i in range(pp_rank * per_stage, (pp_rank + 1) * per_stage)}
    for key in [k for k in model.blocks if k not in owned]:
        del model.blocks[key]
    if pp_rank != 0:
        model.tok_emb = None
    if pp_rank != pp - 1:
        model.norm = None
        model.head = None
    return model


def attention_plan(qk_norm: bool) -> dict:
    """The attention's TP plan. Qwen3's q/k norms act on each rank's own heads (dimension 2 of
    ``[b, s, heads, head_dim]``): their weights are replicated DTensors, so that the gradient,
    a sum over every head, is all-reduced over the TP group (as a sequence-parallel norm's)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    plan: dict = {"attn.wq": col, "attn.wk": col, "attn.wv": col, "attn.wo": row}
    if qk_norm:
        heads = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan.update({"attn.q_norm": heads, "attn.k_norm": heads})
    return plan


def _block_plan(qk_norm: bool) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    return {**attention_plan(qk_norm), "mlp.w1": col, "mlp.w3": col, "mlp.w2": row}


def shards_vocab(cfg: LlamaConfig, tp: int) -> bool:
    """Vocab-parallel embedding and loss-parallel head: only on an even split, untied."""
    return tp > 1 and cfg.vocab_size % tp == 0 and not cfg.tie_embeddings


def apply_tp(model: Llama, tp_mesh) -> Llama:
    from elastic.parallel.tp import apply_block_plan, apply_vocab_parallel

    apply_block_plan(list(model.blocks.values()), tp_mesh, _block_plan(model.cfg.qk_norm))
    if shards_vocab(model.cfg, tp_mesh.size()):
        apply_vocab_parallel(model.tok_emb, model.head, tp_mesh)
    return model


def apply_cp(model: Llama, cp_mesh) -> Llama:
    """Context-parallel attention in every block (``elastic/parallel/cp.py``)."""
    from elastic.parallel.cp import apply_cp as cp_attention

    cp_attention(model.attentions(), cp_mesh)
    return model


def llama_spec(cfg: LlamaConfig) -> ModelSpec:
    from elastic.parallel.tp import loss_context

    return ModelSpec(
        name="llama",
        build=lambda: Llama(cfg),
        init_weights=lambda model, seed: model.init_weights(seed),
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        flops_per_token=cfg.flops_per_token(),
        tp_plan=apply_tp,
        split_stage=build_stage,
        loss_fn=lm_loss,
        loss_context=lambda tp: loss_context(shards_vocab(cfg, tp)),
        validate_layout=cfg.validate_layout,
        memory=cfg.memory_inputs(),
        hf=hf_adapter(cfg),
        cp_plan=apply_cp,
        documents=True,
    )


register_model("llama", llama_spec)
