"""ZeRO sharding (Rajbhandari et al. 2020) with FSDP2 ``fully_shard``.

``fully_shard`` is applied to every block (one all-gather / reduce-scatter group each, so
communication overlaps the neighbouring block's compute), then to the root, which groups
what is left: embeddings, final norm and head. Parameters, gradients and optimizer state
are sharded on dim 0 over the DP mesh between steps under every level; the levels differ
in how long full parameters and full gradients live *during* a step:

====  ===========================================  ============================================  ================
zero  parameters during the step                   gradients during accumulation                 comm per step
====  ===========================================  ============================================  ================
3     resharded after each forward and backward    reduce-scattered each micro-batch (sharded)   2m AG + m RS
      (``reshard_after_forward=True``)
2     gathered once, kept until the last backward  reduce-scattered each micro-batch (sharded)   1 AG + m RS
      (``reshard_after_forward=False`` and
      ``set_reshard_after_backward`` only on the
      last micro-batch)
1     as ZeRO-2                                    accumulated unsharded locally, one            1 AG + 1 RS
                                                   reduce-scatter on the last micro-batch
                                                   (``set_requires_gradient_sync``)
====  ===========================================  ============================================  ================

(m = micro-batches per step.) Honest caveat: FSDP2 has no "replicated parameters, sharded
optimizer state only" mode. DeepSpeed's ZeRO-1/2 keep a full parameter replica at all
times and all-gather the updated partitions after the optimizer step; here the optimizer
always steps the sharded DTensors and the full parameters are all-gathered at the start of
the next forward. Communication volume is the same (one all-gather plus one reduction of
the gradients per step for ZeRO-1), and the peak memory inside a step is that of ZeRO-1/2;
only between steps is it lower.

The root keeps ``reshard_after_forward=False`` at every level: its parameters are the
first needed when backward begins, so resharding them would only add an all-gather.

Experts (``model.moe``) are their own FSDP units, on the mesh of the ranks that hold the
same experts (``ParallelDims.expert_mesh``, dp x cp), inside blocks sharded over the dense
mesh (dp x ep x cp): torchtitan's arrangement. Where no other rank holds the same experts
(dp = cp = 1) they are left out of the blocks' units (``ignored_params``) and keep their
EP sharding alone.

Under pipeline parallelism the stage drives these flags itself (``PipelineStage`` turns
off gradient sync and resharding for all but the last micro-batch), so every level
reduces gradients once per step there; ``reshard_after_forward`` still differs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    zero: int,
    blocks: list[nn.Module],
    bf16: bool = False,
    experts: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard ``model`` (a model or a pipeline stage, possibly TP-sharded) over ``dp_mesh``.

    A 2-D ``dp_mesh`` (``ParallelDims.fsdp_mesh`` under HSDP) makes FSDP2 shard over its
    second dimension and replicate over its first: gradients are reduce-scattered inside a
    shard group, then all-reduced across the groups.

    ``bf16``: FSDP2's mixed precision, bf16 parameters for compute (all-gathered in bf16),
    gradients reduced in fp32; the sharded parameters and optimizer state stay fp32.
    ``experts``: expert modules, sharded over ``expert_mesh`` (None: left alone).
    """
    if zero not in (1, 2, 3):
        raise ValueError(f"apply_fsdp needs zero in 1..3, got {zero}")
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    ignored = expert_params(experts) if expert_mesh is None else set()
    with slices_made_once():
        for unit in experts if expert_mesh is not None else ():
            fully_shard(unit, mesh=expert_mesh, reshard_after_forward=zero == 3, mp_policy=mp)
        for block in blocks:
            fully_shard(
                block, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=mp, ignored_params=ignored or None
            )
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp, ignored_params=ignored or None)
    return model


@contextmanager
def slices_made_once() -> Iterator[None]:
    """Within the block, each slice of a device mesh is made once and then shared.

    Under HSDP, ``fully_shard`` slices the shard dimension out of its 2-D mesh once per
    parameter (``FSDPParam._init_shard_mesh``), and torch 2.13 builds a new ``DeviceMesh``
    each time: 0.8 ms a slice here, 70 ms for the 85 parameters of an 8-block model, paid
    again by every rank at every re-formation (it grew with the model's parameter count:
    the largest part of ``wrap_s``). A mesh and its slices do not change once made, so the
    parameters can share one. Not thread-safe against slicing from another thread
    meanwhile (the worker builds its engine on the training thread; nothing else slices).
    """
    original = DeviceMesh.__getitem__
    made: dict[tuple[int, Any], tuple[DeviceMesh, DeviceMesh]] = {}

    def getitem(self: DeviceMesh, names: Any) -> DeviceMesh:
        key = (id(self), names)
        if key not in made:  # the mesh is kept with its slice: its id is not reused meanwhile
            made[key] = (self, original(self, names))
        return made[key][1]

    DeviceMesh.__getitem__ = getitem  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__getitem__ = original  # type: ignore[method-assign]


def expert_params(experts: Sequence[nn.Module]) -> set[nn.Parameter]:
    return {p for unit in experts for p in unit.parameters()}


def prepare_micro_batch(model: nn.Module, zero: int, is_last: bool) -> None:
    """Set the FSDP flags for the next micro-batch's backward (see the table above)."""
    if not isinstance(model, FSDPModule):
        return
    if zero <= 2:
        model.set_reshard_after_backward(is_last)
    if zero == 1:
        model.set_requires_gradient_sync(is_last)
