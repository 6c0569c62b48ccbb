"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with DTensor ``parallelize_module``.

Plan for each transformer block (the two "f/g" conjugate pairs of the Megatron paper):

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
not applied: it only saves activation memory and needs DTensor norms; a later addition.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from elastic.model import GPT, ModelConfig

BLOCK_PLAN = {
    "attn.wq": ColwiseParallel(),
    "attn.wk": ColwiseParallel(),
    "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),
    "mlp.w1": ColwiseParallel(),
    "mlp.w2": RowwiseParallel(),
}


def shards_vocab(cfg: ModelConfig, tp: int) -> bool:
    """Vocab-parallel embedding and loss-parallel head: only on an even split, untied."""
    return tp > 1 and cfg.vocab_size % tp == 0 and not cfg.tie_embeddings


def apply_tp(model: GPT, tp_mesh: DeviceMesh) -> GPT:
    """Shard ``model`` (a full model or a pipeline stage of it) over ``tp_mesh`` in place."""
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
    if not shards_vocab(model.cfg, tp_mesh.size()):
        return model
    if model.tok_emb is not None:
        parallelize_module(
            model.tok_emb, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        )
    if model.head is not None:
        # use_local_output=False keeps the logits a DTensor sharded on vocab for loss_parallel.
        parallelize_module(model.head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    return model


def loss_context(cfg: ModelConfig, tp: int) -> contextlib.AbstractContextManager:
    """The context the loss forward and backward must run in (loss parallelism or none)."""
    return loss_parallel() if shards_vocab(cfg, tp) else contextlib.nullcontext()


def to_local_value(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss as a plain tensor (no communication)."""
    return loss.to_local() if isinstance(loss, DTensor) else loss
