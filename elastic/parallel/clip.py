"""Gradient clipping by the global norm over every shard of every stage.

``torch.nn.utils.clip_grad_norm_`` cannot take one list mixing plain tensors and
DTensors on different meshes (FSDP over TP gives ``(dp, tp)`` DTensors, FSDP alone
``(dp,)`` ones, TP without FSDP ``(tp,)`` ones), and it does not know about pipeline
stages. So we group the gradients by (mesh, placements), let torch's ``get_total_norm``
reduce each group (a DTensor norm is exact over its shards once ``full_tensor()`` is
taken), add the squares, all-reduce them over the PP group (stages own disjoint
parameters) and scale with torch's ``clip_grads_with_norm_``.

Plain-tensor gradients are replicated on every DP/TP rank (DDP averaged them, TP's
column-wise layers all-reduced them), so they are counted once, locally.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(
    params: Iterable[torch.Tensor], pp_group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=_foreach_ok(grads))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt()


def clip_grad_norm(
    params: Sequence[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None, device: torch.device
) -> float:
    """Clip in place to ``max_norm`` (0 disables) and return the pre-clip global norm."""
    total = global_grad_norm(params, pp_group, device)
    if max_norm > 0:
        grads = [p.grad for p in params if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=_foreach_ok(grads))
    return float(total)


def _foreach_ok(grads: list[torch.Tensor]) -> bool:
    """One foreach kernel per list on CUDA for plain tensors; DTensors of several meshes
    cannot share one foreach call, and on CPU the loop is as fast."""
    return bool(grads) and all(type(g) is torch.Tensor and g.is_cuda for g in grads)
