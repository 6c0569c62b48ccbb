"""Packed documents inside a row: block-diagonal causal attention and positions that restart.

A row of ``document_ids`` (``elastic.ingest.sft_rows``) is cut into documents at every change
of id (a document is a run of equal ids). Token ``i`` attends to token ``j`` only when
``j <= i`` and both are of the same document, and its position (what RoPE rotates by) is its
offset from its document's first token. A row packed from several documents then gives
every document the logits it has when run alone. ``Documents`` is computed once per forward
and handed to every block's attention: a boolean mask for ``scaled_dot_product_attention``
(any device; on CUDA, flex attention's block masks would skip the masked tiles, which this
does not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    positions: torch.Tensor  # [b, s] int64: each token's offset in its document
    mask: torch.Tensor  # [b, 1, s, s] bool: True where query i may attend to key j


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: True where a document begins (the row's first token, and every change of id)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def documents(document_ids: torch.Tensor) -> Documents:
    """The positions and the attention mask of rows of ``document_ids`` (``[b, s]``)."""
    starts = document_starts(document_ids)
    seq = document_ids.shape[1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    run = torch.cumsum(starts.to(torch.int64), dim=1)  # each token's document, counted from 1 in its row
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    mask = (run[:, :, None] == run[:, None, :]) & causal
    return Documents(positions=index - first, mask=mask[:, None])
