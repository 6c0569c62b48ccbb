"""The one place that applies every parallelism to a model, in a fixed order.

``parallelize`` takes a model whose weights are already initialised (the full seeded
model, or a pipeline stage cut from it by ``pp.build_stage_module``) and shards it in
place. Since every rank starts from the same full weights, the initial weights are the
same under every layout by construction. Rebuilding after an elastic resize is just a
second call on a fresh model with a fresh ``ParallelDims``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from elastic.parallel.ac import apply_ac
from elastic.parallel.ddp import apply_ddp
from elastic.parallel.fsdp import apply_fsdp
from elastic.parallel.tp import apply_tp

if TYPE_CHECKING:
    from elastic.parallel.config import ParallelConfig
    from elastic.parallel.dims import ParallelDims


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig) -> nn.Module:
    """Apply TP, then recompute, then FSDP or DDP; returns the module to train.

    The returned module is ``model`` itself, except under classic DDP (zero 0, pure DP),
    which wraps it.
    """
    # 1. Tensor parallelism first: it turns block weights into DTensors on the TP mesh.
    #    FSDP/replicate applied later see those DTensors and compose 2-D (dp, tp)
    #    placements; the reverse order is not supported by torch.
    if dims.tp_enabled:
        apply_tp(model, dims.tp_mesh)

    # 2. Activation checkpointing next, before data parallelism (the order of torchtitan
    #    and of torch's FSDP2 tests): FSDP's hooks then wrap the checkpointed block, so
    #    its parameters are gathered for the recomputation in backward too.
    if cfg.activation_checkpointing:
        apply_ac(model)

    # 3. Data parallelism last, over the DP mesh only. With one replica there is nothing
    #    to shard or average.
    if not dims.dp_enabled:
        return model
    if cfg.zero == 0:
        return apply_ddp(model, dims.dp_mesh, classic=not (dims.tp_enabled or dims.pp_enabled))
    return apply_fsdp(model, dims.dp_mesh, cfg.zero)
