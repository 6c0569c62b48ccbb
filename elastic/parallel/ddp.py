"""Data parallelism with replicated parameters (``parallel.zero == 0``).

Gradients are averaged over the DP mesh only: TP peers hold different shards and PP
peers different layers, so neither takes part. With EP or CP the "DP mesh" of dense
parameters is dp x ep x cp and that of experts dp x cp (``ParallelDims.dense_mesh``,
``expert_mesh``), each unit replicated on its own (see fsdp.py).

* Pure DP (no TP, no PP): ``torch.nn.parallel.DistributedDataParallel`` over the DP
  group. Bucketed all-reduce overlaps backward; gradient accumulation uses ``no_sync``
  for every micro-batch but the last, so there is one all-reduce per step.
* With TP or PP: torch's ``replicate`` (DDP rebuilt on FSDP2's machinery: a replicated
  placement on the DP mesh, gradients all-reduced per block, no-sync via
  ``set_requires_gradient_sync``). Classic DDP cannot hold DTensor parameters (its
  bucket flattening mixes ``Tensor`` and ``DTensor``), and under ``PipelineStage`` it
  fails on the second step (torch 2.13: "rebuilt parameter indices size is not same as
  original model parameters size" from the reducer, because the stage drives DDP's
  reducer by hand). ``PipelineStage`` handles ``replicate`` like FSDP: no gradient sync
  until the last micro-batch, then one all-reduce.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    classic: bool,
    blocks: list[nn.Module],
    init_sync: bool = True,
    experts: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Replicated data parallelism over ``dp_mesh``; returns the module to train.

    ``classic`` selects ``DistributedDataParallel`` (only valid without TP, PP, EP and CP).
    ``init_sync=False`` skips DDP's start-up check and broadcast of rank 0's weights: for a
    re-formation, where every rank then loads the same restored state. ``experts`` are
    replicated over ``expert_mesh`` (None: left out, no other rank holds them).
    """
    if classic:
        return DistributedDataParallel(model, process_group=dp_mesh.get_group(), init_sync=init_sync)
    from elastic.parallel.fsdp import expert_params

    ignored = (expert_params(experts) if expert_mesh is None else set()) or None
    for unit in experts if expert_mesh is not None else ():
        replicate(unit, mesh=expert_mesh)
    for block in blocks:
        replicate(block, mesh=dp_mesh, ignored_params=ignored)
    replicate(model, mesh=dp_mesh, ignored_params=ignored)
    return model


def micro_batch_context(model: nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on every micro-batch but the last one of a step."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if is_last else model.no_sync()
    if isinstance(model, ReplicateModule):
        model.set_requires_gradient_sync(is_last)
    return contextlib.nullcontext()
