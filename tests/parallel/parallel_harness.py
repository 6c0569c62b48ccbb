"""The parallel engine tests' layouts, data and single-process reference.

Ranks are spawned by the one multi-process harness, ``elastic/testing/ranks.py``
(``run_ranks``, ``init_group``), re-exported here. Workers are module-level functions so
spawn can import them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic.models.gpt import ModelConfig
from elastic.models.spec import model_spec
from elastic.optim import TrainConfig, build_optimizer
from elastic.testing.ranks import init_group, run_ranks

__all__ = ["init_group", "run_ranks"]

SEED = 7
MODEL = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)
TRAIN = TrainConfig(steps=20, global_batch=8, lr=1e-2, warmup_steps=1, grad_clip=0.5)
STEPS = 4


@dataclass(frozen=True)
class Layout:
    name: str
    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1
    ac: bool = False
    schedule: str = "1f1b"
    ep: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.ep * self.cp


# ----- data: a learnable, deterministic batch per step ----------------------------------


def global_batch(step: int, n: int = TRAIN.global_batch, cfg: ModelConfig = MODEL) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic token sequences (random start and stride): a model can learn them fast."""
    gen = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, cfg.vocab_size, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def dp_micro_batches(
    step: int, dp: int, dp_rank: int, micro_batch: int, cfg=MODEL, n: int = TRAIN.global_batch
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DP rank r takes samples [r*G/dp, (r+1)*G/dp) of the step's batch, in micro-batches."""
    inputs, targets = global_batch(step, n, cfg=cfg)
    per_rank = inputs.shape[0] // dp
    lo = dp_rank * per_rank
    return [(inputs[i : i + micro_batch], targets[i : i + micro_batch]) for i in range(lo, lo + per_rank, micro_batch)]


def reference_run(steps: int = STEPS, model_cfg=MODEL) -> tuple[list[float], list[float]]:
    """Single process, whole global batch in one forward, torch's own clip_grad_norm_."""
    torch.manual_seed(0)
    spec = model_spec(model_cfg)
    model = spec.build_full(SEED)
    opt, sched = build_optimizer(model, TRAIN)
    losses, norms = [], []
    for step in range(steps):
        inputs, targets = global_batch(step, cfg=model_cfg)
        loss = spec.loss_fn(model(inputs), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN.grad_clip)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, norms
