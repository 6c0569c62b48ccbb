"""Expert parallelism: the experts of each MoE layer sharded over ``ep`` ranks, tokens moved by all-to-all.

Runs on every rank of an EP job, inside the MoE layer's forward (``elastic/models/moe.py``).
The ``ep`` ranks of one model replica each train on their own micro-batches (they are data
parallel for everything but the experts) and each holds ``n_experts / ep`` consecutive
experts. A layer routes its tokens, then (GShard, Lepikhin et al. 2020; Switch, Fedus et
al. 2021; without a capacity limit, as MegaBlocks' dropless MoE, Gale et al. 2022):

1. *dispatch*: the token copies, sorted by expert, are sent to the ranks that own their
   experts with one ``all_to_all_single`` (torch's functional collective, which carries
   autograd: its backward is the reverse all-to-all); the counts go first, in a small
   all-to-all of their own, since the splits differ every step;
2. the received tokens are regrouped by local expert and run through them;
3. *combine*: the outputs go back by the reverse all-to-all, in the order they came.

Expert weights are DTensors sharded on the expert dimension over the ``ep`` mesh
(``distribute_experts``): every rank holds its experts' slice of the full ``[E, ...]``
tensor, so initialisation is seeded per FQN as for any parameter, checkpoints are keyed
by the full shape (they reshard across EP degrees) and the global gradient norm sums the
shards. With TP as well, each expert's hidden dimension is split over the TP ranks too
(Megatron's expert tensor parallelism): a ``(ep, tp)`` mesh, the input of the expert
matmuls passes ``copy_to_tp`` (identity forward, all-reduce of the gradient) and their
output ``reduce_from_tp`` (all-reduce forward), the "f" and "g" of the Megatron paper.

Gradients. An expert on EP rank ``j`` receives the tokens of every EP peer, so its
gradient sums ``ep`` data shards' losses, where a dense weight's holds one; the DP
wrapper then averages over the ``dp x cp`` ranks holding the same experts
(``ParallelDims.expert_mesh``). ``scale_grad(w, 1/ep)`` on the weights in forward makes the
result the gradient of the global mean, as for dense weights averaged over
``dp x ep x cp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class ExpertParallel:
    """What a MoE layer needs to know about its EP (and expert-TP) groups (set by ``apply_ep``)."""

    group: Any  # the EP process group, or None with ep = 1
    size: int
    rank: int
    n_local: int  # experts on this rank
    tp_group: Any = None  # the TP group when each expert's hidden dimension is split

    @property
    def first_expert(self) -> int:
        return self.rank * self.n_local


def dispatch(tokens: torch.Tensor, counts: torch.Tensor, ep: ExpertParallel) -> tuple[torch.Tensor, list[int], Any]:
    """Send expert-sorted token copies to their experts' ranks.

    ``tokens`` ``[M, d]`` are sorted by global expert id, ``counts`` ``[E]`` how many per
    expert. Returns the received tokens grouped by local expert, the count per local expert,
    and what ``combine`` needs to send the outputs back.
    """
    import torch.distributed._functional_collectives as funcol

    per_rank = counts.view(ep.size, ep.n_local)
    received = torch.empty_like(per_rank)
    dist.all_to_all_single(received, per_rank, group=ep.group)  # received[src, e]: src's tokens for my e
    send_splits = per_rank.sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    arrived = funcol.all_to_all_single(tokens, recv_splits, send_splits, ep.group)
    # ``arrived`` is ordered by source rank, then local expert: regroup by local expert.
    expert_of_row = torch.repeat_interleave(
        torch.arange(ep.n_local, device=tokens.device).repeat(ep.size), received.reshape(-1)
    )
    order = torch.argsort(expert_of_row, stable=True)
    local_counts = received.sum(0).tolist()
    return arrived[order], local_counts, (order, send_splits, recv_splits)


def combine(outputs: torch.Tensor, plan: Any, ep: ExpertParallel) -> torch.Tensor:
    """The reverse of ``dispatch``: outputs back to their tokens' ranks, in the sent order."""
    import torch.distributed._functional_collectives as funcol

    order, send_splits, recv_splits = plan
    back_in_arrival_order = torch.empty_like(order)
    back_in_arrival_order[order] = torch.arange(order.numel(), device=order.device)
    unsorted = outputs[back_in_arrival_order]
    return funcol.all_to_all_single(unsorted, send_splits, recv_splits, ep.group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity in forward; multiplies the gradient by ``factor`` in backward."""
    return x if factor == 1.0 else _ScaleGrad.apply(x, factor)


class _CopyToTP(torch.autograd.Function):
    """Megatron's "f": the input is replicated over TP, its gradient is a sum of partials."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's "g": partial outputs summed over TP; the gradient is already replicated."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def distribute_experts(experts: nn.Module, dims: Any, tp_dims: dict[str, int]) -> None:
    """Make ``experts``' ``[E, ...]`` parameters DTensors sharded over ``dims.expert_shard_mesh``.

    The expert dimension (0) is sharded over ``ep``; with TP, each parameter's hidden
    dimension (``tp_dims[name]``) over ``tp`` as well. Works on the meta device.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = dims.expert_shard_mesh
    for name, param in list(experts.named_parameters(recurse=False)):
        placements = []
        if dims.ep > 1:
            placements.append(Shard(0))
        if dims.tp > 1:
            placements.append(Shard(tp_dims[name]))
        placements = placements or [Replicate()]
        sharded = nn.Parameter(distribute_tensor(param.data, mesh, placements), requires_grad=param.requires_grad)
        setattr(experts, name, sharded)


def expert_context(dims: Any, n_experts: int) -> ExpertParallel:
    """This rank's ``ExpertParallel`` (its EP group and slice of the experts)."""
    group = dims.ep_mesh.get_group() if dims.ep > 1 else None
    rank = dims.ep_mesh.get_local_rank() if dims.ep > 1 else 0
    tp_group = dims.tp_mesh.get_group() if dims.tp > 1 else None
    return ExpertParallel(group, dims.ep, rank, n_experts // dims.ep, tp_group)
