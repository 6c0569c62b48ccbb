"""Context parallelism: each sequence split into ``cp`` equal chunks, one per CP rank.

Runs on every rank of a CP job, inside the model's forward. CP rank ``c`` holds tokens
``[c*T/cp, (c+1)*T/cp)`` of every sample of its data shard (the data stream hands it that
slice, ``sequence_slice``): its embeddings, norms, MLPs and experts work on the chunk only,
so activation memory falls by ``cp``. Attention is the one place where tokens of other
chunks are needed, and the scheme here is the simplest exact one, all-gather attention
(as in Llama 3's long-context training, Dubey et al. 2024, §3.3.2):

* each rank rotates its own queries and keys with their *global* positions (the RoPE
  tables start at ``c*T/cp``, ``rope_offset``);
* keys and values are all-gathered over the CP group (``all_gather_single_autograd``:
  its backward reduce-scatters the key/value gradients back to their owners, summing
  every chunk's contribution);
* local queries attend to the gathered keys under a causal mask offset by the chunk's
  start: query ``i`` of chunk ``c`` sees keys ``0 .. c*T/cp + i``.

So every rank computes exactly the rows of the full causal attention that its queries
own, and the loss of the chunks is the loss of the whole sequence (equal chunks: the
mean of chunk means). K/V memory is the full sequence's during attention; a ring
(sending K/V blocks around while computing, as Liu et al. 2023's Ring Attention) would
bound it by two chunks, and a zig-zag chunk order would balance the causal work, which
here is heavier on the last chunk. Neither changes the result; both are left for later.

Gradients: the loss on each CP rank is the mean over its chunk, and dense gradients are
averaged over ``dp x ep x cp`` (``ParallelDims.dense_mesh``), which makes them those of
the mean over the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F


@dataclass
class ContextParallel:
    """What an attention layer needs to know about its CP group (set by ``apply_cp``)."""

    group: Any  # the CP process group
    rank: int
    size: int
    blocking: bool = False  # gather with a blocking collective (gloo: see ``gather_sequence``)

    def rope_offset(self, local_len: int) -> int:
        """Global position of this rank's first token."""
        return self.rank * local_len

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int = 1) -> torch.Tensor:
        """Causal attention of local queries ``[b, h, Tc, d]`` over the whole sequence's keys.

        ``k`` and ``v`` are this chunk's (``[b, h_kv, Tc, d]``, already rotated); they are
        gathered before the grouped-query repeat, so the all-gather moves ``h_kv`` heads.
        """
        local = q.shape[2]
        k_all, v_all = gather_sequence(k, self.group, self.blocking), gather_sequence(v, self.group, self.blocking)
        if n_rep > 1:
            k_all = k_all.repeat_interleave(n_rep, dim=1)
            v_all = v_all.repeat_interleave(n_rep, dim=1)
        mask = chunk_causal_mask(local, local * self.size, self.rope_offset(local), q.device)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


def gather_sequence(x: torch.Tensor, group: Any, blocking: bool) -> torch.Tensor:
    """``[b, h, Tc, d]`` chunks of the CP group -> ``[b, h, T, d]`` in chunk order, with autograd.

    ``blocking`` (gloo) gathers with a plain blocking collective (``_GatherSequence``): torch's
    functional collective (``all_gather_single_autograd``) crashed gloo ranks with heap
    corruption ("malloc(): unaligned tcache chunk", segmentation faults in ``wait_tensor``)
    when the CP group is the world group (dp 1 x cp 2, where the flattened dense mesh is the
    world group too): about one 60-step run in ten on torch 2.13, with or without a
    re-formation before it. Other backends keep the functional collective.
    """
    # Both gather along dim 0 only: put the sequence first and back.
    seq_first = x.permute(2, 0, 1, 3).contiguous()
    if blocking:
        gathered = _GatherSequence.apply(seq_first, group)
    else:
        import torch.distributed._functional_collectives as funcol

        gathered = funcol.all_gather_single_autograd(seq_first, 0, group)
    return gathered.permute(1, 2, 0, 3)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0; its backward reduce-scatters the gradient back to its owners."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        # reduce_scatter_single in the torch versions that have it (reduce_scatter_tensor is
        # deprecated there), reduce_scatter_tensor before.
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(out, grad, group=ctx.group)
        return out, None


def chunk_causal_mask(q_len: int, k_len: int, q_start: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[q_len, k_len]``: query at global position ``q_start + i`` sees keys ``<=`` it."""
    q_pos = torch.arange(q_start, q_start + q_len, device=device)
    return torch.arange(k_len, device=device)[None, :] <= q_pos[:, None]


class SplitsSequence(Protocol):
    """An attention module that attends over the chunks of a split sequence once given a context."""

    cp: ContextParallel | None


def apply_cp(attention_modules: Sequence[SplitsSequence], cp_mesh: Any) -> ContextParallel:
    """Make each attention module context-parallel over ``cp_mesh`` (sets its ``cp``)."""
    import torch.distributed as dist

    group = cp_mesh.get_group()
    ctx = ContextParallel(group, cp_mesh.get_local_rank(), cp_mesh.size(), dist.get_backend(group) == "gloo")
    for module in attention_modules:
        module.cp = ctx
    return ctx


def sequence_slice(rows: Any, cp: int, cp_rank: int) -> Any:
    """CP rank ``cp_rank``'s part of token rows of ``T + 1`` tokens (inputs and shifted targets).

    Inputs ``[c*Tc, (c+1)*Tc)`` and their next tokens: the rows' columns
    ``[c*Tc, (c+1)*Tc + 1)``. Works on numpy arrays and tensors alike.
    """
    if cp == 1:
        return rows
    chunk = (rows.shape[1] - 1) // cp
    return rows[:, cp_rank * chunk : (cp_rank + 1) * chunk + 1]
