"""Random access by global row index over a directory of parquet files: the native reader
(``data.loader: native``), the reference every other reader is tested against, and the
preflight's and the per-rank Ray Data pipeline's reader. Runs in the rank that reads
(``elastic.ingest.corpus.RankStream``) or in a Ray Data actor.

A corpus may hold ``loss_mask`` and ``document_ids`` beside ``tokens`` (SFT data, docs/data.md):
its rows are then the columns side by side, ``[rows, width * len(columns)]`` in the order of
``ParquetCorpus.columns`` (``elastic.ingest.sft_rows.split_columns`` takes them apart).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic.ingest.listing import corpus_files
from storage import url_to_fs

TOKENS = "tokens"
LOSS_MASK = "loss_mask"  # optional, 0/1: position i says whether predicting token i counts
DOCUMENT_IDS = "document_ids"  # optional: rows packed from several documents (elastic/ingest/sft_rows.py)
SFT_COLUMNS = (LOSS_MASK, DOCUMENT_IDS)  # beside ``tokens``, each seq_len + 1 long, in this order

READ_ROWS = 1024  # rows a ParquetCorpus reads at once (consecutive row groups of one file)


def _as_rows(col: Any, where: str) -> np.ndarray:
    """A ``tokens`` column (fixed-size or variable lists) as int64 ``[rows, width]``."""
    width = col.type.list_size if pa.types.is_fixed_size_list(col.type) else None
    if width is not None:
        return col.flatten().to_numpy(zero_copy_only=False).astype(np.int64).reshape(-1, width)
    lists = [np.asarray(x, dtype=np.int64) for x in col.to_pylist()]
    if len({len(x) for x in lists}) > 1:
        from elastic.errors import CorpusError

        raise CorpusError(f"{where}: rows of {sorted({len(x) for x in lists})} ids")
    return np.stack(lists)


class ParquetCorpus:
    """Random access by global row index over a directory of parquet files (via fsspec)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None, cache_row_groups: int = 8):
        self.uri = uri
        self.fs, root = url_to_fs(uri, storage_options)
        if self.fs.isdir(root):
            files = corpus_files(self.fs, root)
        else:
            files = [root]
        if not files:
            raise FileNotFoundError(f"no parquet files under {uri}")
        self._groups: list[tuple[str, int, int]] = []  # (file, row_group, first_row)
        self._meta: dict[str, Any] = {}  # each file's footer, read once here
        starts = []
        total = 0
        columns: tuple[str, ...] | None = None
        for path in files:
            with self.fs.open(path, "rb") as f:
                pf = pq.ParquetFile(f)
                meta, names = pf.metadata, pf.schema_arrow.names
            if TOKENS not in names:
                raise ValueError(f"{path} has no '{TOKENS}' column")
            have = (TOKENS, *(c for c in SFT_COLUMNS if c in names))
            if columns is not None and have != columns:
                raise ValueError(f"{path} has the columns {have}; the corpus's first file has {columns}")
            columns = have
            self._meta[path] = meta
            for g in range(meta.num_row_groups):
                self._groups.append((path, g, total))
                starts.append(total)
                total += meta.row_group(g).num_rows
        self.num_rows = total
        self.columns: tuple[str, ...] = columns or (TOKENS,)  # tokens first, then the SFT columns it has
        self._starts = np.asarray(starts, dtype=np.int64)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_size = cache_row_groups
        self.bytes_read = 0

    def _row_group(self, gi: int) -> np.ndarray:
        """Row group ``gi``'s rows. A miss reads it with the next groups of its file, up to
        ``READ_ROWS`` rows, in one open: a prepared corpus's groups are a few rows each."""
        if gi in self._cache:
            self._cache.move_to_end(gi)
            return self._cache[gi]
        path, g, first = self._groups[gi]
        last = gi
        while last + 1 < len(self._groups) and self._groups[last + 1][0] == path:
            if self._groups[last + 1][2] + 1 - first > READ_ROWS:
                break
            last += 1
        meta = self._meta[path]
        with self.fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f, metadata=meta)
            table = pf.read_row_groups(list(range(g, g + last - gi + 1)), columns=list(self.columns))
        self.bytes_read += sum(meta.row_group(h).total_byte_size for h in range(g, g + last - gi + 1))
        where = f"{path} row groups {g}..{g + last - gi}"
        parts = [_as_rows(table.column(c).combine_chunks(), f"{where} column {c!r}") for c in self.columns]
        if len({p.shape[1] for p in parts}) > 1:
            from elastic.errors import CorpusError

            widths = ", ".join(f"{c} {p.shape[1]}" for c, p in zip(self.columns, parts))
            raise CorpusError(f"{where}: columns of different widths ({widths})")
        arr = parts[0] if len(parts) == 1 else np.hstack(parts)
        at = 0
        for h in range(gi, last + 1):
            n = meta.row_group(self._groups[h][1]).num_rows
            self._cache[h] = arr[at : at + n]
            at += n
        while len(self._cache) > max(self._cache_size, 2 * (last - gi + 1)):
            self._cache.popitem(last=False)
        return self._cache[gi]

    def rows(self, sample_indices: np.ndarray) -> np.ndarray:
        rows = np.asarray(sample_indices, dtype=np.int64) % self.num_rows
        out = None
        groups = np.searchsorted(self._starts, rows, side="right") - 1
        for gi in np.unique(groups):
            mask = groups == gi
            block = self._row_group(int(gi))
            picked = block[rows[mask] - self._starts[gi]]
            if out is None:
                out = np.empty((len(rows), picked.shape[1]), dtype=np.int64)
            out[mask] = picked
        if out is None:
            raise ValueError("ParquetCorpus.rows: no sample indices")
        return out
