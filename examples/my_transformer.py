"""A user's own model for ``model.kind: custom`` (see docs/models.md and custom-model.yaml).

This file is yours: nothing here is part of the platform. It shows the whole contract:
``build`` returns an ``elastic.models.ModelSpec`` that tells the engine how to build the
model (on the meta device), how to seed its weights, how to cut it into pipeline stages
and what it costs. It gives no TP plan, so the platform refuses ``parallel.tp > 1`` for it
before the run starts; add one like ``elastic/models/llama.py`` does if you need it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elastic.models.spec import ModelSpec, lm_loss, normal_or_ones, seeded_init
from elastic.parallel.memory_model import MemoryInputs


class Block(nn.Module):
    """Pre-norm block: multi-head causal attention (one fused QKV linear) and a ReLU² MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.down(F.relu(self.up(self.norm2(x))).square())


class TinyLM(nn.Module):
    """Embedding -> blocks -> norm -> head. Any part may be None on a pipeline stage."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int):
        super().__init__()
        self.embed: nn.Embedding | None = nn.Embedding(vocab, dim)
        self.pos: nn.Parameter | None = nn.Parameter(torch.zeros(seq_len, dim))
        # A ModuleDict keyed by layer index: a stage that drops layers keeps every FQN.
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(dim)
        self.out: nn.Linear | None = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.out(self.norm(x))
        return x


def split_stage(model: TinyLM, pp: int, rank: int) -> TinyLM:
    """Keep the layers of stage ``rank``; the first stage the embeddings, the last the head."""
    per = len(model.blocks) // pp
    for key in [k for k in model.blocks if not rank * per <= int(k) < (rank + 1) * per]:
        del model.blocks[key]
    if rank != 0:
        model.embed, model.pos = None, None
    if rank != pp - 1:
        model.norm, model.out = None, None
    return model


def build(vocab_size: int = 64, dim: int = 32, layers: int = 2, heads: int = 4, seq_len: int = 16) -> ModelSpec:
    """The factory named by ``model.factory``; ``model.args`` are its keyword arguments."""
    if dim % heads:
        raise ValueError(f"heads={heads} must divide dim={dim}")
    block_params = 12 * dim * dim  # qkv 3d², proj d², up and down 8d²
    # Ones for the LayerNorm weights, zeros for biases, N(0, 0.02) for everything else.
    init = normal_or_ones(
        0.02,
        0.02 / (2 * layers) ** 0.5,
        ("norm1.weight", "norm2.weight", "norm.weight"),
        ("proj.weight", "down.weight"),
    )

    def validate(tp: int, pp: int) -> None:
        from elastic.errors import SpecError

        if layers % pp:
            raise SpecError("parallel.pp", f"{pp} does not divide model.args.layers ({layers})")

    return ModelSpec(
        name="my_transformer",
        build=lambda: TinyLM(vocab_size, dim, layers, heads, seq_len),
        init_weights=lambda model, seed: seeded_init(model, seed, init),
        vocab_size=vocab_size,
        seq_len=seq_len,
        flops_per_token=6.0 * (layers * block_params + 2 * vocab_size * dim) + 12.0 * layers * dim * seq_len,
        split_stage=split_stage,
        loss_fn=lm_loss,
        validate_layout=validate,
        memory=MemoryInputs(
            n_layers=layers,
            d_model=dim,
            n_heads=heads,
            seq_len=seq_len,
            vocab_size=vocab_size,
            block_split=block_params,
            block_whole=4 * dim,
            first_split=vocab_size * dim,
            first_whole=seq_len * dim,
            last_split=vocab_size * dim,
            last_whole=2 * dim,
            act_scores=0,  # fused scaled_dot_product_attention: no stored s x s softmax
        ),
    )
