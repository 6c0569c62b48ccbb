"""Optimizer and learning-rate schedule (spec key ``train``)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class AdamWConfig(BaseModel):
    """``train.optimizer`` with ``name: adamw`` (the default): torch's AdamW, decoupled
    weight decay on the matrices only (norms and biases get none)."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["adamw"] = "adamw"
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float | None = Field(None, ge=0, description="default: train.weight_decay")


class SGDConfig(BaseModel):
    """``train.optimizer`` with ``name: sgd``: torch's SGD (L2 weight decay on the matrices
    only, none by default; momentum 0 keeps no state at all)."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["sgd"]
    momentum: float = Field(0.0, ge=0, lt=1)
    dampening: float = Field(0.0, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = Field(0.0, ge=0)

    @field_validator("nesterov")
    @classmethod
    def _nesterov_needs_momentum(cls, value: bool, info: ValidationInfo) -> bool:
        if value and (info.data.get("momentum", 0.0) == 0 or info.data.get("dampening", 0.0) != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening 0")
        return value


OptimizerConfig = Annotated[AdamWConfig | SGDConfig, Field(discriminator="name")]


# A rate above this has no use (steps a thousand times the gradient) and, past float32's
# range, fails every step on the workers ("cannot be converted to type float without
# overflow"), each retried as a worker error.
MAX_LR = 1e3


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(100, ge=1)
    global_batch: int = Field(48, ge=1)
    lr: float = Field(3.0e-4, gt=0, le=MAX_LR, description=f"at most {MAX_LR:g}")
    warmup_steps: int | None = Field(None, ge=0, description="default: 10% of steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.1, ge=0, description="AdamW's, unless train.optimizer gives one")
    optimizer: OptimizerConfig = Field(default_factory=AdamWConfig)
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="after the linear warmup: decay to min_lr_ratio (cosine, linear), none, or wsd"
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd: the share of train.steps spent in the final linear decay"
    )
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="compute precision; default bf16 on CUDA, fp32 on CPU (state stays fp32)"
    )
    compile: bool = Field(False, description="torch.compile each transformer block")
    eval_every: int = Field(
        0, ge=0, description="steps between evals of data.eval_source (the eval event's eval_loss); 0: none"
    )
    tensorboard: bool | str = Field(
        False,
        description="write TensorBoard scalars: true for RUN_DIR/tensorboard, or a directory (docs/observability.md)",
    )

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer_name(cls, value: object) -> object:
        if isinstance(value, str):  # ``optimizer: sgd`` is short for ``{name: sgd}``
            value = {"name": value}
        if isinstance(value, dict) and value.get("name", "adamw") not in ("adamw", "sgd"):
            raise ValueError(f"name must be 'adamw' or 'sgd', got {value.get('name')!r}")
        if isinstance(value, dict) and "name" not in value:
            value = {**value, "name": "adamw"}
        return value

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
    """The multiple of ``train.lr`` at ``step`` (counted from 0): a linear warmup over
    ``cfg.warmup`` steps, then by ``train.schedule``:

    - ``cosine``: cosine decay to ``min_lr_ratio`` at ``train.steps``;
    - ``linear``: linear decay to ``min_lr_ratio`` at ``train.steps``;
    - ``constant``: 1 after the warmup;
    - ``wsd`` (warmup-stable-decay): 1 until the last ``decay_fraction`` of ``train.steps``,
      then linear decay to ``min_lr_ratio`` at ``train.steps``.
    """
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        decay_start = max(cfg.warmup, cfg.steps - max(1, round(cfg.decay_fraction * cfg.steps)))
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, cfg.steps - decay_start))
        return 1.0 - (1.0 - floor) * progress
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * cosine


def optimizer_impl(params: list[torch.Tensor]) -> dict[str, bool]:
    """The fused CUDA kernel where every parameter is a plain CUDA tensor (one launch for the
    whole update, as torchtitan uses); the per-parameter loop otherwise: DTensors of
    several meshes (TP x FSDP x PP) cannot share one foreach or fused call."""
    plain_cuda = bool(params) and all(type(p.data) is torch.Tensor and p.is_cuda for p in params)
    return {"fused": True} if plain_cuda else {"foreach": False}


def state_bytes_name(cfg: TrainConfig) -> str:
    """The optimizer as the memory model counts its state (``memory_terms.STATE_BYTES``):
    SGD without momentum keeps none."""
    opt = cfg.optimizer
    if isinstance(opt, SGDConfig):
        return "sgd" if opt.momentum > 0 else "sgd_plain"
    return "adamw"


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt_cfg = cfg.optimizer
    impl = optimizer_impl(decay + no_decay)
    opt: torch.optim.Optimizer
    if isinstance(opt_cfg, SGDConfig):
        groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.SGD(
            groups,
            lr=cfg.lr,
            momentum=opt_cfg.momentum,
            dampening=opt_cfg.dampening,
            nesterov=opt_cfg.nesterov,
            **impl,
        )
    else:
        wd = cfg.weight_decay if opt_cfg.weight_decay is None else opt_cfg.weight_decay
        groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps, **impl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return opt, sched
