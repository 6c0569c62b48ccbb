"""The one place that applies every parallelism to a model, in a fixed order.

``parallelize`` takes a model built on the meta device (the full model, or the pipeline
stage its ``ModelSpec.split_stage`` cut from it), shards it with the model's TP plan,
materialises it on the device, initialises it from the seed (``ModelSpec.init_weights``,
per-FQN seeded, so the weights are the same under every layout by construction), then
applies recompute, ``torch.compile`` and data parallelism; under FSDP the materialising
comes after the sharding, so a rank allocates only its own shards. Rebuilding after an elastic
resize is a second call on a fresh model with a fresh ``ParallelDims``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from elastic.parallel.ac import apply_ac
from elastic.parallel.ddp import apply_ddp
from elastic.parallel.fsdp import apply_fsdp
from elastic.parallel.live import dtensor_like

if TYPE_CHECKING:
    from elastic.parallel.config import ParallelConfig
    from elastic.parallel.dims import ParallelDims
    from elastic.protocols.model_spec import ModelSpec

Plan = TypeVar("Plan")


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    cfg: ParallelConfig,
    spec: ModelSpec,
    seed: int,
    device: torch.device,
    *,
    bf16: bool = False,
    compile: bool = False,
    timings: dict[str, float] | None = None,
    restoring: bool = False,
    kept: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """TP, EP and CP, then materialise and init, then recompute, compile, FSDP or DDP; returns the module to train.

    The returned module is ``model`` itself, except under classic DDP (zero 0, pure DP),
    which wraps it. With ``bf16`` and ``zero >= 1`` FSDP is applied even with one replica,
    so that its mixed-precision policy (and so the numerics) does not change when an
    elastic job shrinks to dp=1.

    ``kept`` (with ``restoring``): a survivor's own local shards of this layout's parameters,
    by name. Under FSDP they become the parameters' storage (``adopt_shards``), so the
    restore that follows finds them in place and copies nothing.
    """
    # 1. Tensor parallelism first (on the meta device): it turns block weights into
    #    DTensors on the TP mesh. FSDP/replicate applied later see those DTensors and
    #    compose 2-D (dp, tp) placements; the reverse order is not supported by torch.
    t0 = time.perf_counter()
    if dims.tp_enabled:
        required_plan(spec.tp_plan, "tp_plan")(model, dims.tp_mesh)
    # 1b. Experts next (still on the meta device): sharded over EP (and TP), and each MoE
    #     layer told its EP group; then the attention told its CP group (no parameters).
    experts = spec.ep_plan(model, dims) if spec.ep_plan is not None else []
    if dims.cp_enabled:
        required_plan(spec.cp_plan, "cp_plan")(model, dims.cp_mesh)

    # 2. Materialise and fill from the seed. A restore overwrites every value right after,
    #    so the fill is skipped then, unless the model holds buffers, which no checkpoint
    #    holds; parameters shared between modules, which ``to_empty`` unties, are tied again
    #    without it. Under FSDP this waits until the parameters are sharded (step 5, the
    #    order of torchtitan): each rank then allocates only its own shard, instead of the
    #    whole stage that FSDP would copy its shard out of (a re-formation under HSDP paid
    #    that in proportion to the model). A model with tied parameters keeps the early
    #    order: FSDP registers one of the two modules' parameters, and ``to_empty`` after
    #    sharding would leave the other one untied.
    tied = tied_parameters(model)
    fill = not restoring or any(True for _ in model.buffers())
    blocks = spec.blocks(model)
    dense_dp = dims.dense_dp > 1
    fsdp = cfg.zero >= 1 and (dense_dp or bf16)
    shard_first = fsdp and not tied
    if not shard_first:
        _materialize(model, spec, seed, device, fill, tied)
    t1 = time.perf_counter()
    late_s = 0.0  # materialising after FSDP

    # 3. Activation checkpointing next, before data parallelism (the order of torchtitan
    #    and of torch's FSDP2 tests): FSDP's hooks then wrap the checkpointed block, so
    #    its parameters are gathered for the recomputation in backward too.
    if cfg.activation_checkpointing:
        apply_ac(blocks)

    # 4. torch.compile per block (torchtitan's grain): every block has the same code and
    #    shapes, so one compiled graph serves them all; ``Module.compile`` keeps the FQNs.
    if compile:
        for block in blocks:
            block.compile()

    # 5. Data parallelism last: dense parameters over the dp x ep x cp mesh, experts over
    #    the dp x cp ranks that hold the same ones. With one replica and no EP or CP there
    #    is nothing to shard or average (but see bf16 above). Under HSDP
    #    (``parallel.shard_group``, ep = cp = 1) FSDP gets the 2-D (replicate, shard) mesh
    #    and shards over the second dimension only (``ParallelDims.fsdp_mesh``).
    expert_mesh = dims.expert_mesh if dims.expert_dp > 1 else None
    if fsdp:
        wrapped = apply_fsdp(
            model, dims.fsdp_mesh, cfg.zero, blocks, bf16=bf16, experts=experts, expert_mesh=expert_mesh
        )
        if shard_first:
            t2 = time.perf_counter()
            if restoring and kept and not fill:  # a survivor's shards are adopted before anything is
                adopt_shards(model, kept, device)  # allocated: only the rest gets storage of its own
                empty_where_meta(model, device)
            else:
                _materialize(model, spec, seed, device, fill, tied)  # this rank's shards only
                if restoring and kept:
                    adopt_shards(model, kept)
            late_s = time.perf_counter() - t2
    elif not dense_dp:
        wrapped = model
    else:
        classic = not (dims.tp_enabled or dims.pp_enabled or dims.ep_enabled or dims.cp_enabled)
        wrapped = apply_ddp(
            model,
            dims.dense_mesh,
            classic=classic,
            blocks=blocks,
            init_sync=not restoring,
            experts=experts,
            expert_mesh=expert_mesh,
        )
    if timings is not None:
        timings["materialize_s"] = t1 - t0 + late_s
        timings["wrap_s"] = time.perf_counter() - t1 - late_s
    return wrapped


def _materialize(model: nn.Module, spec: ModelSpec, seed: int, device: torch.device, fill: bool, tied: list) -> None:
    """Allocate the (local shards of the) parameters and buffers on ``device``; fill them from
    the seed, or tie the shared ones again when the fill is skipped."""
    model.to_empty(device=device)
    if fill:
        spec.init_weights(model, seed)
    else:
        retie(model, tied)


def empty_where_meta(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` for the parameters and buffers still on the meta device only: those a
    survivor adopted keep their storage. (``to_empty`` would allocate, and dispatch, for
    every one of them: 0.25 ms per DTensor parameter here, in proportion to the model's
    depth.) FSDP takes the new parameters as its sharded data at its lazy init, as after
    ``adopt_shards``."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                empty = torch.empty_like(param, device=device)
                module._parameters[name] = nn.Parameter(empty, requires_grad=param.requires_grad)
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device=device)


def adopt_shards(model: nn.Module, kept: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Make each sharded parameter whose local shard ``kept`` holds (same shape, dtype and
    device: ``device``, for a model still on the meta device) a DTensor over that very
    tensor: a survivor's shards become the new FSDP's storage instead of being copied into
    it (FSDP takes a new parameter's local tensor as its sharded data at its lazy init; an
    unevenly sharded one is padded there, a copy)."""
    from torch.distributed.tensor import DTensor

    for name, param in list(model.named_parameters()):
        value = kept.get(name)
        if not isinstance(param, DTensor) or value is None:
            continue
        local = param.to_local()
        if (value.shape, value.dtype, value.device) != (local.shape, local.dtype, device or local.device):
            continue
        _set_parameter(model, name, nn.Parameter(dtensor_like(value, param), requires_grad=param.requires_grad))


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter shared between modules (a tied embedding and output
    head), the first one first: what ``retie`` restores after ``to_empty``."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(model: nn.Module, tied: list[list[str]]) -> None:
    """Share each group's first parameter again with the others (``to_empty`` gave each
    module its own)."""
    for first, *others in tied:
        param = model.get_parameter(first)
        for name in others:
            _set_parameter(model, name, param)


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, param)


def required_plan(plan: Plan | None, name: str) -> Plan:
    """One of the model's ``ModelSpec`` plans that the layout needs. ``ModelSpec.check_layout``
    refuses such a layout for a model without it before anything is built, so a missing one
    here is a bug, not bad input."""
    if plan is None:
        raise RuntimeError(f"the layout needs the model's {name}, which it lacks (check_layout was skipped)")
    return plan
