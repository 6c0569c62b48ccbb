"""The reference model: a small decoder-only GPT.

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
import zlib
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["gpt"] = "gpt"
    n_layers: int = Field(4, ge=1)
    d_model: int = Field(128, ge=8)
    n_heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=2)
    seq_len: int = Field(64, ge=2)
    tie_embeddings: bool = False
    mlp_ratio: int = Field(4, ge=1)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


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
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for fqn, param in self.named_parameters():
            gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, fqn))
            if fqn.endswith(("ln1.weight", "ln2.weight", "norm.weight")):
                value = torch.ones(param.shape)
            elif fqn.endswith("bias"):
                value = torch.zeros(param.shape)
            else:
                std = residual_std if fqn.endswith(("wo.weight", "w2.weight")) else 0.02
                value = torch.randn(param.shape, generator=gen) * std
            _copy_full_into(param, value)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n


def _param_seed(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63 - 1)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-shape value into a parameter that may be a sharded DTensor."""
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()  # type: ignore[assignment]
    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements)
        param.copy_(local)
    else:
        param.copy_(full.to(param.device, param.dtype))


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward), 6N + 12·L·d·T as in PaLM's MFU."""
    d, L, T = cfg.d_model, cfg.n_layers, cfg.seq_len
    per_layer = 4 * d * d + 2 * cfg.mlp_ratio * d * d
    n = L * per_layer + cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return 6.0 * n + 12.0 * L * d * T


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> GPT:
    model = GPT(cfg).to(device)
    model.init_weights(seed)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every token of the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
