"""The training step of the hand-written DDP baselines (the torchrun script of ``overhead``,
the Ray Train side of ``recovery_vs_raytrain``), the way a user would write it: ``no_sync``
for every micro-batch but the last, global-norm clipping, AdamW and its schedule. Runs in
each baseline's rank processes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from elastic.models.gpt import lm_loss


def ddp_step(
    model: Any, params: list[Any], micro_batches: list[tuple[Any, Any]], optimizer: Any, scheduler: Any, clip: float
) -> float:
    """One optimizer step of the DDP ``model`` over ``(inputs, targets)`` micro-batches, the
    gradient norm of ``params`` clipped to ``clip`` (0: off); returns their mean local loss."""
    accum = len(micro_batches)
    local = 0.0
    for i, (inputs, targets) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == accum - 1 else model.no_sync():
            loss = lm_loss(model(inputs), targets)
            (loss / accum).backward()
        local += float(loss.detach())
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return local / accum
