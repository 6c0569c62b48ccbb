"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with DTensor ``parallelize_module``.

The helpers here are model-agnostic; each model's ``ModelSpec.tp_plan`` (elastic/models/)
applies them. For the reference GPT, the plan for each transformer block (the two "f/g"
conjugate pairs of the Megatron paper):

* attention: ``wq``, ``wk``, ``wv`` column-wise (each TP rank owns ``n_heads / tp`` whole
  heads, so attention itself runs locally with no communication), ``wo`` row-wise: one
  all-reduce of the block output in forward, one of the input gradient in backward.
* MLP: ``w1`` column-wise, GELU locally on the shard, ``w2`` row-wise: one more all-reduce.

Outside the blocks (only when ``vocab_size % tp == 0`` and embeddings are untied):

* ``tok_emb`` is vocab-parallel (row-wise on the embedding table): each rank looks up the
  ids in its vocabulary slice, masked partial sums are all-reduced. It saves ``(tp-1)/tp``
  of the largest table's memory and optimizer state.
* ``head`` is column-wise with its output left sharded on the vocabulary dimension, and
  the cross entropy runs under ``loss_parallel``: the full ``[batch, seq, vocab]`` logits
  are never gathered, which is where TP pays the most at large vocabularies. The loss and
  its backward must then run inside ``loss_context``.
* ``pos_emb`` and the LayerNorms stay replicated: they are tiny, and their gradients are
  already identical on every TP rank because the column-wise layers all-reduce the input
  gradient in backward.

Sequence parallelism (sharding the LayerNorm/residual activations along the sequence) is
not applied, and the memory model does not assume it: with DTensor's ``SequenceParallel``
the column-wise linears would still save their all-gathered input whole, so it would split
only the norms' own tensors, and it would reshape every pipeline stage's I/O and the
sequence dimension that context parallelism uses (docs/sweep.md, "How the memory model
counts"). Note also that torch's DTensor embedding backward returns the vocab-parallel
table's gradient as a replicated, full-size tensor on every TP rank.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

# The reference GPT's block plan; a model's own plan lives with the model (elastic/models/).
BLOCK_PLAN = {
    "attn.wq": ColwiseParallel(),
    "attn.wk": ColwiseParallel(),
    "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),
    "mlp.w1": ColwiseParallel(),
    "mlp.w2": RowwiseParallel(),
}


def apply_block_plan(blocks: list[nn.Module], tp_mesh: DeviceMesh, plan: dict) -> None:
    """Apply one ``parallelize_module`` plan to every block."""
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)


def apply_vocab_parallel(tok_emb: nn.Module | None, head: nn.Module | None, tp_mesh: DeviceMesh) -> None:
    """Vocab-parallel embedding and a head whose logits stay sharded for ``loss_parallel``."""
    if tok_emb is not None:
        parallelize_module(tok_emb, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if head is not None:
        # use_local_output=False keeps the logits a DTensor sharded on vocab for loss_parallel.
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))


def loss_context(sharded_logits: bool) -> contextlib.AbstractContextManager:
    """The context the loss forward and backward must run in (loss parallelism or none)."""
    return loss_parallel() if sharded_logits else contextlib.nullcontext()


def to_local_value(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss as a plain tensor (no communication)."""
    return loss.to_local() if isinstance(loss, DTensor) else loss
