"""Optimizer and learning-rate schedule (spec key ``train``)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(100, ge=1)
    global_batch: int = Field(48, ge=1)
    lr: float = Field(3.0e-4, gt=0)
    warmup_steps: int | None = Field(None, ge=0, description="default: 10% of steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="compute precision; default bf16 on CUDA, fp32 on CPU (state stays fp32)"
    )
    compile: bool = Field(False, description="torch.compile each transformer block")
    tensorboard: bool | str = Field(
        False,
        description="write TensorBoard scalars: true for RUN_DIR/tensorboard, or a directory (docs/observability.md)",
    )

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_dir(cls, value: bool | str) -> bool | str:
        if isinstance(value, str) and not value.strip():
            raise ValueError("must be true, false or a directory, got an empty string")
        return value

    def resolved_dtype(self, device_type: str) -> str:
        return self.dtype or ("bf16" if device_type == "cuda" else "fp32")

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 10)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio``; ``step`` counts from 0."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def optimizer_impl(params: list[torch.Tensor]) -> dict[str, bool]:
    """The fused CUDA kernel where every parameter is a plain CUDA tensor (one launch for the
    whole update, as torchtitan uses); the per-parameter loop otherwise: DTensors of
    several meshes (TP x FSDP x PP) cannot share one foreach or fused call."""
    plain_cuda = bool(params) and all(type(p.data) is torch.Tensor and p.is_cuda for p in params)
    return {"fused": True} if plain_cuda else {"foreach": False}


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, **optimizer_impl(decay + no_decay))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return opt, sched
