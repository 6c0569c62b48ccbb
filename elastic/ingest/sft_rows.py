"""SFT rows: a corpus's ``loss_mask`` and ``document_ids`` columns turned into what a step trains on.

A row of ``seq_len + 1`` positions gives the inputs ``tokens[:-1]`` and the targets
``tokens[1:]``. Target ``i`` (predicting token ``i + 1``) counts when

* ``loss_mask[i + 1]`` is 1 (position i's value says whether predicting token i counts), and
* with ``document_ids``, tokens ``i`` and ``i + 1`` are of the same document: the first token
  of a packed document is never predicted from the one before it, as it is not when the
  document is run alone.

A target that does not count is ``IGNORE`` (-100, what ``torch.nn.functional.cross_entropy``
skips). A document is a run of equal ids: attention never crosses one and positions restart
at each (``elastic.models.documents``). The step's loss is the mean over the counted targets
of the global batch (``elastic.engine``). Pure numpy; runs in the rank that reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic.ingest.parquet_corpus import DOCUMENT_IDS, LOSS_MASK, TOKENS

IGNORE = -100


@dataclass(frozen=True)
class SftRows:
    """The columns of some rows, each ``[rows, seq_len + 1]`` int64 (``None``: not in the corpus)."""

    tokens: np.ndarray
    loss_mask: np.ndarray | None = None
    document_ids: np.ndarray | None = None

    def targets(self) -> np.ndarray:
        """``tokens[:, 1:]`` with every target that does not count set to ``IGNORE``."""
        targets = self.tokens[:, 1:].copy()
        counted = np.ones(targets.shape, dtype=bool)
        if self.loss_mask is not None:
            counted &= self.loss_mask[:, 1:] != 0
        if self.document_ids is not None:
            counted &= self.document_ids[:, 1:] == self.document_ids[:, :-1]
        targets[~counted] = IGNORE
        return targets


def split_columns(rows: np.ndarray, columns: tuple[str, ...]) -> SftRows:
    """Rows read as the columns side by side (``ParquetCorpus.rows``) taken apart."""
    parts = dict(zip(columns, np.split(rows, len(columns), axis=1)))
    return SftRows(parts[TOKENS], parts.get(LOSS_MASK), parts.get(DOCUMENT_IDS))


def check_columns(rows: SftRows, where: str) -> None:
    """``CorpusError`` on a ``loss_mask`` that is not 0/1 (a retry would read the same rows)."""
    if rows.loss_mask is not None and rows.loss_mask.size and not np.isin(rows.loss_mask, (0, 1)).all():
        from elastic.errors import CorpusError

        bad = int(rows.loss_mask[~np.isin(rows.loss_mask, (0, 1))][0])
        raise CorpusError(f"{where}: column '{LOSS_MASK}' holds {bad}; it must be 0 or 1")
