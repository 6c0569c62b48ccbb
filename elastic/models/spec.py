"""The model registry and the layout-independent initialisation every model uses.

* the registry: ``model.kind`` -> a function of the config returning its ``ModelSpec``
  (``register_model``, ``register_variant``, ``model_spec(cfg)``), and a built-in model's
  pipeline stage through its spec (``build_stage_module``);
* seeded initialisation: every parameter from a generator seeded by ``(seed, FQN)``
  (``seeded_init``, ``normal_or_ones``), the same weights under any layout.

``ModelSpec`` itself, its contract and ``lm_loss`` live in ``elastic/protocols/model_spec.py``
(below ``models/`` and ``parallel/``); they are named here too, where model modules and
users' factories import them from. See docs/models.md.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastic.errors import SpecError
from elastic.protocols.model_spec import ModelSpec, default_blocks, lm_loss  # noqa: F401  (named here too)

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


def build_stage_module(model: nn.Module, pp: int, pp_rank: int) -> nn.Module:
    """Turn a built-in model (``model.cfg``) into stage ``pp_rank`` of ``pp`` in place, keeping FQNs."""
    split_stage = model_spec(model.cfg).split_stage
    if split_stage is None:  # check_layout refuses pp > 1 for such a model before any worker starts
        raise RuntimeError(f"{type(model).__name__} cannot be split into parallel.pp={pp} stages")
    return split_stage(model, pp, pp_rank)


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
