"""A data shard's share of the eval corpus (``data.eval_source``), as the micro-batches
``TrainEngine.eval_loss`` takes. Runs in the rank that evaluates.

The corpus's ``N`` rows are cut into ``shards`` contiguous shares of ``ceil(N / shards)``
rows (shard ``s`` takes rows ``[s * per, (s + 1) * per)``, the last ones fewer), and every
share is padded to ``per`` rows and then to whole micro-batches with rows whose targets are
all ``IGNORE``: each rank runs as many forwards (a sharded model gathers its parameters in
each, with every rank of its group), and a padding row counts nothing. Every row is in
exactly one share, so the sum of the counted targets' losses and their number, summed over
the shards (``eval_loss``'s all-reduce), give the mean over the whole corpus at any DP
degree. Targets are those of training (``elastic.ingest.sft_rows``: ``loss_mask`` and
document boundaries apply).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from elastic.ingest.parquet_corpus import ParquetCorpus
from elastic.ingest.sft_rows import IGNORE, check_columns, split_columns


def share(num_rows: int, shards: int, shard: int) -> tuple[int, int, int]:
    """``(first, end, per)``: shard ``shard``'s rows ``[first, end)`` and the rows every share is padded to."""
    per = -(-num_rows // shards)
    first = min(num_rows, shard * per)
    return first, min(num_rows, first + per), per


def eval_micro_batches(
    corpus: ParquetCorpus,
    shards: int,
    shard: int,
    micro_batch: int,
    row_check: Callable[[np.ndarray, str], None] | None = None,
) -> list[tuple]:
    """Shard ``shard``'s micro-batches: ``(inputs, targets)``, or ``(inputs, targets, document_ids)``
    when the corpus has ``document_ids`` (module docstring). ``row_check(tokens, where)`` sees
    the share's token rows first (``elastic.ingest.preflight.check_rows``)."""
    first, end, per = share(corpus.num_rows, shards, shard)
    n = -(-per // micro_batch) * micro_batch  # rows run: whole micro-batches
    # A share past the corpus's end (more shards than rows) reads row 0 and counts none of it.
    picked = np.arange(first, end, dtype=np.int64) if end > first else np.zeros(1, dtype=np.int64)
    rows = split_columns(corpus.rows(picked), corpus.columns)
    where = f"{corpus.uri} rows {first}..{end - 1}"
    check_columns(rows, where)
    if row_check is not None:
        row_check(rows.tokens, where)
    targets = rows.targets()
    targets[end - first :] = IGNORE
    pad = n - len(picked)
    width = rows.tokens.shape[1]

    def padded(a: np.ndarray, fill: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(np.concatenate([a, np.full((pad, a.shape[1]), fill, a.dtype)])))

    inputs, target_t = padded(rows.tokens[:, :-1], 0), padded(targets, IGNORE)
    docs = None if rows.document_ids is None else padded(rows.document_ids[:, :-1], 0)
    assert inputs.shape == (n, width - 1)
    out: list[tuple] = []
    for i in range(0, n, micro_batch):
        mb = (inputs[i : i + micro_batch], target_t[i : i + micro_batch])
        out.append(mb if docs is None else (*mb, docs[i : i + micro_batch]))
    return out
