"""Activation checkpointing (recomputation, Chen et al. 2016) per transformer block.

Each block keeps only its input during forward and recomputes its activations in
backward: activation memory drops from O(layers x block activations) to O(layers x
d_model) plus one block's worth, for about one extra forward pass of compute.

We use torch's composable ``checkpoint`` (non-reentrant, hook-based) rather than the
``checkpoint_wrapper`` module wrapper: it does not insert ``_checkpoint_wrapped_module``
into parameter names, so every FQN stays what ``init_weights`` seeds and what checkpoints
are keyed by, under every layout. It composes with ``fully_shard`` (applied after it) and
with DTensor TP (applied before it), and works with ``torch.distributed.pipelining``
because its backward is plain autograd.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint


def apply_ac(blocks: list[nn.Module]) -> None:
    """Checkpoint every block (of a full model or a pipeline stage) in place."""
    for block in blocks:
        checkpoint(block)
