"""``ModelSpec``: everything the engine needs to know about a model, in one small object.

In the manner of torchtitan's ``TrainSpec``: the engine never looks inside a model, it
calls the spec. A spec is bound to one model config (``model_spec(cfg)``); a user's
factory (``model.kind: custom``) returns one directly. See docs/models.md.

The contract the engine relies on:

* ``build()`` returns the full model; the engine calls it under ``torch.device("meta")``,
  so it must allocate nothing real. ``init_weights(model, seed)`` then fills the
  materialised (possibly pipeline-cut, possibly TP-sharded) model. ``seeded_init`` gives
  every parameter its own generator seeded by ``(seed, FQN)`` and writes the full value
  into whatever shard a rank holds: the weights depend on the seed only, never on the
  layout, which is what makes every layout (and every elastic resize) train the same model.
* ``blocks(model)`` lists the repeated units: the grain of FSDP, activation checkpointing
  and ``torch.compile``.
* ``tp_plan(model, tp_mesh)`` shards it in place (``None``: no tensor parallelism).
* ``ep_plan(model, dims)`` shards its experts over ``dims.expert_shard_mesh`` and returns
  the expert modules (``None``: no experts); ``cp_plan(model, cp_mesh)`` makes its
  attention context-parallel (``None``: no context parallelism). See docs/parallelism.md.
* ``set_loss_scale(model, scale)`` tells a model with auxiliary losses injected in backward
  (the MoE balance loss) the factor the engine applies to each micro-batch's loss.
* ``split_stage(model, pp, pp_rank)`` keeps only stage ``pp_rank``, without renaming any
  parameter (``None``: no pipeline parallelism). Checkpoints are keyed by FQN.
* ``loss_fn(outputs, targets)`` is the mean loss of a micro-batch; it runs inside
  ``loss_context(tp)`` (e.g. torch's ``loss_parallel``).
* ``flops_per_token`` (training, forward + backward) feeds MFU; ``memory`` the memory model.
* ``check_layout(tp, pp)`` refuses what the model cannot do, naming the spec field.
* ``hf`` maps the model to and from a Hugging Face model (``model.init_from``, ``elastic
  ckpt export --format hf``): its ``config.json``, tensor names and RoPE row layout
  (``elastic.models.hf.HFAdapter``; ``None``: neither is possible).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic.errors import SpecError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from elastic.models.hf import HFAdapter
    from elastic.parallel.memory_model import MemoryInputs


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every token of the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """``model.blocks`` (a ModuleDict or ModuleList) if the model has one, else no blocks."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    return []


def _no_context(tp: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    init_weights: Callable[[nn.Module, int], None]
    vocab_size: int
    seq_len: int
    flops_per_token: float = 0.0
    blocks: Callable[[nn.Module], list[nn.Module]] = default_blocks
    tp_plan: Callable[[nn.Module, DeviceMesh], Any] | None = None
    split_stage: Callable[[nn.Module, int, int], nn.Module] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    loss_context: Callable[[int], contextlib.AbstractContextManager] = _no_context
    validate_layout: Callable[..., None] | None = None
    memory: MemoryInputs | None = None
    hf: HFAdapter | None = None
    ep_plan: Callable[[nn.Module, Any], list[nn.Module]] | None = None
    cp_plan: Callable[[nn.Module, DeviceMesh], Any] | None = None
    set_loss_scale: Callable[[nn.Module, float], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def check_layout(self, tp: int, pp: int, ep: int = 1, cp: int = 1) -> None:
        """Refuse a layout the model cannot run, with the spec field at fault.

        ``validate_layout`` is called as ``(tp, pp)``, and with ``ep=``/``cp=`` keywords only
        when one of them is above 1 (a model with an ``ep_plan`` or ``cp_plan`` takes them).
        """
        if tp > 1 and self.tp_plan is None:
            raise SpecError("parallel.tp", f"model {self.name!r} has no TP plan; it needs parallel.tp=1 (got {tp})")
        if pp > 1 and self.split_stage is None:
            raise SpecError("parallel.pp", f"model {self.name!r} has no stage split; it needs parallel.pp=1 (got {pp})")
        if ep > 1 and self.ep_plan is None:
            raise SpecError("parallel.ep", f"model {self.name!r} has no experts to shard; it needs parallel.ep=1")
        if cp > 1 and self.cp_plan is None:
            raise SpecError(
                "parallel.cp", f"model {self.name!r} has no context-parallel attention; it needs parallel.cp=1"
            )
        if self.validate_layout is not None:
            if ep == 1 and cp == 1:
                self.validate_layout(tp, pp)
            else:
                self.validate_layout(tp, pp, ep=ep, cp=cp)

    def build_full(self, seed: int, device: str | torch.device = "cpu") -> nn.Module:
        """The whole model, materialised on ``device`` and initialised (a reference run)."""
        with torch.device("meta"):
            model = self.build()
        model.to_empty(device=device)
        self.init_weights(model, seed)
        return model


# ----- the registry: model.kind -> a function of the config returning its spec -------------
# Filled by the model modules as they are imported: ``elastic/models/__init__.py`` lists
# them, and Python runs it before any module of the package, so the registry is full
# whenever ``model_spec`` can be reached (and this module imports no model: no circle).

_REGISTRY: dict[str, Callable[[Any], ModelSpec]] = {}
# kind -> (when, fn): a variant of a kind chosen by its config (``model.moe`` on a Llama)
_VARIANTS: dict[str, list[tuple[Callable[[Any], bool], Callable[[Any], ModelSpec]]]] = {}


def register_model(kind: str, fn: Callable[[Any], ModelSpec]) -> None:
    _REGISTRY[kind] = fn


def register_variant(kind: str, when: Callable[[Any], bool], fn: Callable[[Any], ModelSpec]) -> None:
    """``fn`` builds the spec of a ``kind`` config for which ``when(cfg)`` holds (the variant's
    module imports the base model, so the base cannot import it back)."""
    _VARIANTS.setdefault(kind, []).append((when, fn))


def model_spec(cfg: Any) -> ModelSpec:
    """The ``ModelSpec`` of a model config (``ModelSpec`` passes through)."""
    if isinstance(cfg, ModelSpec):
        return cfg
    kind = getattr(cfg, "kind", None)
    if kind not in _REGISTRY:
        raise SpecError("model.kind", f"unknown kind {kind!r}; known: {', '.join(sorted(_REGISTRY))}")
    for when, fn in _VARIANTS.get(kind, []):
        if when(cfg):
            return fn(cfg)
    return _REGISTRY[kind](cfg)


# ----- layout-independent initialisation ------------------------------------------------------


def param_seed(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63 - 1)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-shape value into a parameter that may be a sharded DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements)
        param.copy_(local)
    else:
        param.copy_(full.to(param.device, param.dtype))


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int, value: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]):
    """Fill every parameter with ``value(fqn, full_shape, generator)``, the generator seeded
    by ``(seed, fqn)``: the same weights under any layout, creation order or stage."""
    for fqn, param in model.named_parameters():
        fqn = fqn.removeprefix("module.")
        gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, fqn))
        copy_full_into(param, value(fqn, tuple(param.shape), gen))


def normal_or_ones(std: float, residual_std: float, ones: tuple[str, ...], residual: tuple[str, ...]):
    """A common ``seeded_init`` rule: ones for norm weights, zeros for biases, N(0, std) else
    (``residual_std`` for the projections into the residual stream)."""

    def value(fqn: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        if fqn.endswith(ones):
            return torch.ones(shape)
        if fqn.endswith("bias"):
            return torch.zeros(shape)
        return torch.randn(shape, generator=gen) * (residual_std if fqn.endswith(residual) else std)

    return value
