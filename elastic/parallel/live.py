"""A rank's live training state, kept across a re-formation so that a survivor restores nothing.

Runs in the worker. When a generation ends (a peer failed, or the group stops to resize),
the worker lets go of its engine: the process groups, the DP wrappers, the pipeline
schedule. What it trained stays in memory as a ``LiveState``, and when the new layout
gives this rank the same state to hold (``ConfigureRequest.keep_state``, from
``elastic/control/regroup.py``), the new engine takes it over instead of restoring a
snapshot:

* pure DP under DDP (``zero`` 0, no TP, no PP): the module, its optimizer and LR schedule
  are kept whole; the new engine wraps the same module in a DDP over the new DP group
  (the old wrapper's gradient hooks went with it). Nothing is copied or rebuilt.
* every other layout (TP, PP, FSDP, HSDP): the rank's local shards of the parameters and of
  the optimizer state are kept, by parameter name. The new engine (built for the new mesh)
  copies the parameter shards into its own (the DP wrapper owns their storage) and takes
  the optimizer state over as it is, wrapped as DTensors of the new mesh without a copy
  (``restore.load_live_into``): no snapshot is read, no resharding is planned, and no
  state dict is built.

The step and data position always come from the rank's own memory snapshot of the resumed
step (the engine holds no data position), so a kept state is used only at a step that
snapshot exists for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from elastic.parallel.config import ParallelConfig
    from elastic.parallel.dims import ParallelDims


@dataclass
class LiveState:
    """What a rank held when its engine was let go: the state of optimizer step ``step`` as
    rank ``rank`` of a layout of DP degree ``dp``."""

    step: int
    rank: int
    dp: int
    module: nn.Module | None = None  # pure DP under DDP: the unwrapped module, kept whole
    optimizer: Any = None
    scheduler: Any = None
    params: dict[str, torch.Tensor] | None = None  # otherwise: local parameter shards by name
    optim: dict[str, dict[str, Any]] | None = None  # and their optimizer state (local tensors)


def keeps_module(cfg: ParallelConfig, dims: ParallelDims) -> bool:
    """Is the whole module kept (pure DP under DDP), rather than its local shards?"""
    return cfg.zero == 0 and not (dims.tp_enabled or dims.pp_enabled or dims.ep_enabled or dims.cp_enabled)


def release(engine: Any, step: int, rank: int) -> LiveState:
    """Take ``engine``'s live state out of it; the engine is unusable afterwards."""
    if keeps_module(engine.parallel_cfg, engine.dims):
        live = LiveState(step, rank, engine.dims.dp, engine.module, engine.optimizer, engine.scheduler)
    else:
        named = dict(engine.named_params)  # as built: a failure mid-step leaves FSDP's unsharded stand-ins
        state = engine.optimizer.state
        params = {n: _local(p).detach() for n, p in named.items()}
        optim = {n: {k: _local(v) for k, v in state[p].items()} for n, p in named.items() if p in state}
        live = LiveState(step, rank, engine.dims.dp, params=params, optim=optim)
    engine.model = engine.module = engine.gpt = engine.optimizer = engine.scheduler = engine.schedule = None
    engine.pipeline_stage = None
    engine._params, engine.named_params = [], []
    engine._sd_cache = None
    return live


def held_in_cycles(live: LiveState | None) -> bool:
    """Might the released engine's objects hold its process groups in reference cycles, so
    that only a garbage collection lets them go? Not when its module was kept whole (pure DP
    under DDP: the wrapper holds the group and goes with its last reference); FSDP's and
    DTensor's state does. Unknown (no live state) counts as yes."""
    return live is None or live.module is None


def dtensor_like(local: torch.Tensor, param: Any) -> Any:
    """``local`` as a DTensor of ``param``'s mesh, placements, global shape and stride: this
    rank's shard of a tensor laid out as ``param`` (a kept parameter shard, or its optimizer
    state). Made with ``param``'s own spec (as FSDP2 does for its sharded parameters) where
    the shard matches its local tensor in shape, stride and dtype: ``DTensor.from_local``
    costs 0.05 ms a tensor against 0.005 ms, paid for every parameter and optimizer state
    tensor of every survivor at each re-formation. Otherwise through ``from_local``. Never
    requires grad: a parameter wraps it in its own ``nn.Parameter``."""
    from torch.distributed.tensor import DTensor

    mine = param.to_local()
    if (local.shape, local.stride(), local.dtype) == (mine.shape, mine.stride(), mine.dtype):
        return DTensor(local, param._spec, requires_grad=False)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def rewrap(module: nn.Module, dims: ParallelDims) -> nn.Module:
    """The kept module, in a DDP over the new DP group (none at DP 1)."""
    if not dims.dp_enabled:
        return module
    return DistributedDataParallel(module, process_group=dims.dp_mesh.get_group(), init_sync=False)
