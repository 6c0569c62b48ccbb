"""Pipeline parallelism with ``torch.distributed.pipelining``.

Each PP rank builds the full model on the meta device, then its ``ModelSpec.split_stage``
deletes what the rank does not own (for the built-in models: the blocks outside its
contiguous slice, the embeddings unless it is the first stage, the final norm and head
unless it is the last). Blocks live in a ``ModuleDict`` keyed by layer index, so every
remaining parameter keeps its full-model FQN (``blocks.5.attn.wq.weight`` stays that on
stage 1): checkpoints reshard across PP layouts. Only the stage is then materialised.

The stage module is then parallelized like a full model (TP, recompute, FSDP/DDP) and
wrapped in a ``PipelineStage``. The schedule is 1F1B (PipeDream-Flush, Narayanan et al.
2021) by default: at most ``pp - stage`` micro-batches of activations in flight instead of
all ``m`` as in GPipe (Huang et al. 2019). torch's 1F1B needs ``m >= pp``; with fewer
micro-batches we fall back to GPipe, which has the same bubble.

Gradient accumulation *is* the micro-batching: the ``grad_accum`` micro-batches of a step
are the pipeline's ``n_microbatches``. The loss function is the per-micro-batch mean and
the schedule divides the accumulated gradients by ``m`` (``scale_grads=True``), so they
are the gradient of this replica's mean loss; DP averaging then makes them the gradient
of the global mean. Per-micro-batch losses exist only on the last stage; the engine
broadcasts their mean over the PP group.

Bubble: every stage idles ``p - 1`` micro-batch slots of forward+backward per step, so
the bubble fraction (idle time over useful time) is ``(p - 1) / m``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle


def stage_layers(n_layers: int, pp: int, pp_rank: int) -> range:
    """The contiguous block indices that stage ``pp_rank`` owns (``pp`` divides layers)."""
    per_stage = n_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def build_stage(stage_module: nn.Module, pp_mesh: DeviceMesh, device: torch.device) -> PipelineStage:
    """The ``PipelineStage`` of this rank (its index is the rank's place in the PP group)."""
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    return PipelineStage(stage_module, stage_index=pp_rank, num_stages=pp, device=device, group=pp_mesh.get_group())


def build_schedule(
    stage: PipelineStage,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: str = "1f1b",
) -> PipelineScheduleSingle:
    cls = Schedule1F1B if schedule == "1f1b" and n_microbatches >= stage.num_stages else ScheduleGPipe
    return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


def bubble_fraction(pp: int, n_microbatches: int) -> float:
    return (pp - 1) / n_microbatches


def received_buffers(stage: PipelineStage) -> list[torch.Tensor]:
    """The stage's receive buffers (activations in, their gradients back): one per
    micro-batch, allocated by the first step and kept. Receives write into them in place,
    so a live-tensor count (``elastic/parallel/memtrack.py``) must register them."""
    infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
    return [info.buffer for recv in infos for info in recv if getattr(info, "buffer", None) is not None]
