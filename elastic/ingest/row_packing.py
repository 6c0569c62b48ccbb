"""Documents packed whole into rows of ``width`` tokens (first fit), with their ``loss_mask`` and
``document_ids`` columns: ``elastic prepare --format chat``'s packer. Pure numpy.

A document goes into the first open row with room for it, else into a new row; at most
``open_rows`` rows are open at once (the oldest is closed, its rest padded, when one more
is needed), so memory stays bounded and the output depends only on the input's order. A
document is never cut across rows, except one longer than a row, which ``overlong`` decides:

- ``refuse`` (the default): ``SpecError`` naming ``--seq-len``, with the document's place;
- ``truncate``: its first ``width`` tokens are kept, the rest dropped (counted);
- ``split``: cut into pieces of ``width`` tokens, each packed as a document of its own
  (counted): attention does not cross a cut and the first token of a piece is not predicted.

``document_ids`` hold each document's number in the input (from 0), the same for every piece
of a split one; padding is ``PAD_DOCUMENT`` with ``loss_mask`` 0 and the tokenizer's pad id.
A row's documents are in the order they were packed. ``pack=False`` puts each document in a
row of its own (padding each conversation to the row: what packing is measured against,
``benchmarks/sft_packing.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from elastic.errors import SpecError

PAD_DOCUMENT = -1
OVERLONG = ("refuse", "truncate", "split")


@dataclass
class PackStats:
    documents: int = 0
    rows: int = 0
    tokens: int = 0  # of documents (not padding) in the rows
    counted: int = 0  # targets counted in the loss
    truncated: int = 0  # documents cut to one row (--overlong truncate)
    dropped_tokens: int = 0  # what truncation dropped
    split: int = 0  # documents cut into several (--overlong split)

    def fill(self, width: int) -> float:
        """Fraction of the rows' tokens that are not padding."""
        return self.tokens / (self.rows * width) if self.rows else 0.0

    def counted_fraction(self, width: int) -> float:
        """Fraction of the rows' targets (``width - 1`` per row) counted in the loss."""
        return self.counted / (self.rows * (width - 1)) if self.rows else 0.0


@dataclass(eq=False)  # rows are told apart by identity (``list.remove``)
class _Row:
    ids: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    docs: list[int] = field(default_factory=list)
    used: int = 0


class RowPacker:
    """``add(ids, mask, where)`` documents in order, ``finish()`` at the end; full rows go to
    ``emit(tokens, loss_mask, document_ids)`` (each ``[width]``) in the order they close."""

    def __init__(
        self,
        width: int,
        pad_id: int,
        emit: Callable[[np.ndarray, np.ndarray, np.ndarray], None],
        overlong: str = "refuse",
        open_rows: int = 64,
        pack: bool = True,
    ):
        if overlong not in OVERLONG:
            raise SpecError("--overlong", f"{overlong!r} is not one of {', '.join(OVERLONG)}")
        self.width, self.pad_id, self.emit, self.overlong = width, pad_id, emit, overlong
        self.open_rows = max(1, open_rows)
        self.pack = pack  # False: one document a row, the rest padding (the baseline packing is measured against)
        self._open: list[_Row] = []
        self.stats = PackStats()

    def add(self, ids: np.ndarray, mask: np.ndarray, where: str) -> None:
        """One document: its token ids and loss mask (0/1 per token, the same length)."""
        doc = self.stats.documents
        self.stats.documents += 1
        if len(ids) == 0:
            return
        if len(ids) > self.width:
            if self.overlong == "refuse":
                raise SpecError(
                    "--seq-len",
                    f"{where}: a conversation of {len(ids)} tokens is longer than a row (seq_len + 1 = {self.width}); "
                    "raise --seq-len, or pass --overlong truncate (drop its end) or split (cut it into rows)",
                )
            if self.overlong == "truncate":
                self.stats.truncated += 1
                self.stats.dropped_tokens += len(ids) - self.width
                self._place(ids[: self.width], mask[: self.width], doc)
                return
            self.stats.split += 1
            for at in range(0, len(ids), self.width):
                self._place(ids[at : at + self.width], mask[at : at + self.width], doc)
            return
        self._place(ids, mask, doc)

    def _place(self, ids: np.ndarray, mask: np.ndarray, doc: int) -> None:
        n = len(ids)
        row = next((r for r in self._open if self.width - r.used >= n), None) if self.pack else None
        if row is None:
            if len(self._open) == self.open_rows:
                self._close(self._open.pop(0))
            row = _Row()
            self._open.append(row)
        row.ids.append(ids)
        row.mask.append(mask)
        row.docs.append(doc)
        row.used += n
        self.stats.tokens += n
        self.stats.counted += int(mask[1:].sum())  # a document's first token is never predicted
        if row.used == self.width or not self.pack:
            self._open.remove(row)
            self._close(row)

    def _close(self, row: _Row) -> None:
        pad = self.width - row.used
        tokens = np.concatenate([*row.ids, np.full(pad, self.pad_id, dtype=np.int32)]).astype(np.int32)
        mask = np.concatenate([*row.mask, np.zeros(pad, dtype=np.int8)]).astype(np.int8)
        docs = np.concatenate(
            [*(np.full(len(i), d, dtype=np.int32) for i, d in zip(row.ids, row.docs)), np.full(pad, PAD_DOCUMENT)]
        ).astype(np.int32)
        self.stats.rows += 1
        self.emit(tokens, mask, docs)

    def finish(self) -> None:
        """Close every open row, oldest first."""
        while self._open:
            self._close(self._open.pop(0))
