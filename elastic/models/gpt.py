"""The reference model (``model.kind: gpt``): a small decoder-only GPT.

Design choices that the rest of the runtime relies on:

* Blocks live in an ``nn.ModuleDict`` keyed by layer index, so a pipeline stage can drop
  the layers it does not own while every remaining parameter keeps its fully-qualified
  name (FQN). Checkpoints are keyed by FQN, which is what makes them reshardable across
  pipeline layouts.
* Attention projections are separate ``wq/wk/wv/wo`` linears and the MLP is ``w1/w2``, so
  tensor parallelism is a plain column/row-wise plan over named submodules.
* The forward pass tolerates missing pieces (no embedding on a later pipeline stage, no
  head on an earlier one): the same class serves every stage.
* ``init_weights(seed)`` draws every parameter from its own generator seeded by
  ``(seed, FQN)``. The initial weights therefore depend only on the seed, never on the
  parallel layout, the creation order or which stage holds the parameter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elastic.models.config import GPTConfig
from elastic.models.spec import ModelSpec, lm_loss, normal_or_ones, register_model, seeded_init

ModelConfig = GPTConfig  # the historical name


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(bsz, seq, -1)
        return self.wo(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids -> logits on a full model; hidden states in or out on a pipeline stage."""
        if self.tok_emb is not None:
            if self.pos_emb is None:
                raise RuntimeError("a GPT stage that embeds tokens needs its position embeddings too")
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Layout-independent init: each tensor has its own generator seeded by (seed, FQN)."""
        if self.cfg.tie_embeddings and self.head is not None and self.tok_emb is not None:
            self.head.weight = self.tok_emb.weight  # ``to_empty`` after a meta build unties them
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        rule = normal_or_ones(
            0.02, residual_std, ("ln1.weight", "ln2.weight", "norm.weight"), ("wo.weight", "w2.weight")
        )
        seeded_init(self, seed, rule)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n


def flops_per_token(cfg: GPTConfig) -> float:
    return cfg.flops_per_token()


def build_stage(model: GPT, pp: int, pp_rank: int) -> GPT:
    """Keep stage ``pp_rank`` of ``pp`` in place, keeping FQNs (``pp`` divides the layers)."""
    per_stage = model.cfg.n_layers // pp
    owned = {str(i) for i in range(pp_rank * per_stage, (pp_rank + 1) * per_stage)}
    for key in [k for k in model.blocks if k not in owned]:
        del model.blocks[key]
    if pp_rank != 0:
        model.tok_emb = None
        model.pos_emb = None
    if pp_rank != pp - 1:
        model.norm = None
        model.head = None
    return model


def shards_vocab(cfg: GPTConfig, tp: int) -> bool:
    """Vocab-parallel embedding and loss-parallel head: only on an even split, untied."""
    return tp > 1 and cfg.vocab_size % tp == 0 and not cfg.tie_embeddings


def apply_tp(model: GPT, tp_mesh) -> GPT:
    """Megatron plan per block (see elastic/parallel/tp.py), vocab-parallel ends when even."""
    from elastic.parallel.tp import BLOCK_PLAN, apply_block_plan, apply_vocab_parallel

    apply_block_plan(list(model.blocks.values()), tp_mesh, BLOCK_PLAN)
    if shards_vocab(model.cfg, tp_mesh.size()):
        apply_vocab_parallel(model.tok_emb, model.head, tp_mesh)
    return model


def gpt_spec(cfg: GPTConfig) -> ModelSpec:
    from elastic.parallel.tp import loss_context

    return ModelSpec(
        name="gpt",
        build=lambda: GPT(cfg),
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
    )


register_model("gpt", gpt_spec)


def build_model(cfg: GPTConfig, seed: int, device: str | torch.device = "cpu") -> GPT:
    model = GPT(cfg).to(device)
    model.init_weights(seed)
    return model


__all__ = ["GPT", "GPTConfig", "ModelConfig", "build_model", "flops_per_token", "gpt_spec", "lm_loss"]
