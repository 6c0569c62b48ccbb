"""How a prepared corpus's shards are laid out in parquet, and how a part of one is read back.

A shard is one ``tokens`` column of fixed-size int32 lists, written in row groups of
``rows_per_group`` rows with page checksums (CRC32) on and column statistics off (a
smaller footer; the prepared corpus's index holds the vocabulary instead), without a
dictionary and compressed with zstd: with groups of a few rows a dictionary page per group
costs more than it saves (docs/data.md has the measurement).

A reader that knows the footer (``footer_span`` says where it is; its sha256 is in the
index) fetches only the byte ranges of the row groups it needs (``group_span``) and decodes
them with ``decode_groups``: pyarrow reads them through ``RangeFile``, a file that holds only
the fetched bytes, and verifies every page's checksum. A whole shard is verified against the
index's sha256 (``decode_shard``). With a version 3 index a reader needs no footer at all:
each row group's own metadata is in the shard's sidecar (``elastic.ingest.sidecar``). Runs
wherever shards are written (``elastic prepare``) or read (the host feeders and their Ray
Data read tasks).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic.ingest.index import sha256
from elastic.ingest.parquet_corpus import TOKENS

FOOTER_TAIL = 8  # a parquet file ends with the footer's length (4 bytes) and the magic "PAR1"


def encode_shard(rows: np.ndarray, rows_per_group: int, store_schema: bool = True) -> bytes:
    """``rows`` (``[n, width]`` ids) as a parquet shard (see the module docstring).
    ``store_schema=False`` leaves the Arrow schema out of the footer (a sidecar's
    mini-footers: ``elastic.ingest.sidecar``); the column chunks are the same."""
    width = rows.shape[1]
    flat = pa.array(np.ascontiguousarray(rows, dtype=np.int32).reshape(-1))
    table = pa.table({TOKENS: pa.FixedSizeListArray.from_arrays(flat, width)})
    return encode_table(table, rows_per_group, store_schema)


def encode_table(table: pa.Table, rows_per_group: int, store_schema: bool = True) -> bytes:
    """``table`` as a parquet shard with the corpus writer's settings (zstd, page checksums,
    no statistics or dictionary)."""
    buf = io.BytesIO()
    pq.write_table(
        table,
        buf,
        row_group_size=rows_per_group,
        write_statistics=False,
        write_page_checksum=True,
        use_dictionary=False,
        compression="zstd",
        store_schema=store_schema,
    )
    return buf.getvalue()


def footer_span(data: bytes) -> tuple[int, int]:
    """``(offset, length)`` of a parquet file's footer, its length and magic included."""
    if len(data) < 12 or data[-4:] != b"PAR1":
        raise OSError("not a parquet file (no PAR1 magic at its end)")
    length = int.from_bytes(data[-8:-4], "little") + FOOTER_TAIL
    return len(data) - length, length


def parse_footer(footer: bytes, digest: str, name: str) -> pq.FileMetaData:
    """A footer fetched alone (``footer_span``'s bytes), verified against the index's sha256."""
    if sha256(footer) != digest:
        raise OSError(f"{name}: footer checksum mismatch (damaged or replaced shard)")
    return pq.read_metadata(pa.BufferReader(footer))


def group_span(meta: pq.FileMetaData, g: int) -> tuple[int, int]:
    """``[start, end)`` bytes of row group ``g`` (its one column chunk) in the shard."""
    col = meta.row_group(g).column(0)
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    return int(start), int(start) + int(col.total_compressed_size)


def groups_span(meta: pq.FileMetaData, first: int, count: int) -> tuple[int, int]:
    """``[start, end)`` bytes of row groups ``first .. first + count - 1``: one ranged read."""
    spans = [group_span(meta, g) for g in range(first, first + count)]
    return min(s for s, _ in spans), max(e for _, e in spans)


class RangeFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``[start, start + len(blob))`` is here.
    pyarrow reads row groups through it with the footer passed in; a read outside the
    fetched range is an error, never a silent fetch."""

    def __init__(self, size: int, start: int, blob: bytes):
        super().__init__()
        self._size, self._start, self._blob, self._pos = size, start, memoryview(blob), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._size - self._pos)
        lo = self._pos - self._start
        if n > 0 and (lo < 0 or lo + n > len(self._blob)):
            raise OSError(f"read of bytes {self._pos}..{self._pos + n} outside the fetched range")
        b[:n] = self._blob[lo : lo + n]
        self._pos += n
        return n


def rows_of(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A ``tokens`` column (lists of one length) as int32 ``[rows, width]``."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col.flatten().to_numpy().astype(np.int32, copy=False).reshape(len(col), -1)


def decode_groups(
    meta: pq.FileMetaData, size: int, start: int, blob: bytes, first: int, count: int, name: str
) -> np.ndarray:
    """Row groups ``first .. first + count - 1`` of a shard of ``size`` bytes, from the bytes
    ``blob`` fetched at ``start``, as int32 rows; every page's checksum is verified."""
    source = RangeFile(size, start, blob)
    try:
        pf = pq.ParquetFile(source, metadata=meta, page_checksum_verification=True)
        rows = rows_of(pf.read_row_groups(list(range(first, first + count)), columns=[TOKENS]).column(TOKENS))
    except (OSError, pa.ArrowException) as exc:
        raise OSError(f"{name} row groups {first}..{first + count - 1}: {exc}") from exc
    want = sum(meta.row_group(g).num_rows for g in range(first, first + count))
    if len(rows) != want:
        raise OSError(f"{name} row groups {first}..{first + count - 1}: {len(rows)} rows, {want} expected")
    return rows


def decode_shard(data: bytes, digest: str, name: str) -> np.ndarray:
    """A shard's bytes, verified against the index's sha256, as int32 rows."""
    if sha256(data) != digest:
        raise OSError(f"{name}: checksum mismatch (damaged or replaced shard)")
    return rows_of(pq.read_table(io.BytesIO(data), columns=[TOKENS]).column(TOKENS))
