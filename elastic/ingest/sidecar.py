"""A shard's row-group sidecar (index version 3): each row group's own parquet footer, so a
host reader fetches the metadata of the groups it reads and nothing else.

For row group ``g`` of a shard, ``elastic prepare`` also writes those rows alone as a
parquet file with the shard's writer settings (``shard_format.encode_shard``, one row
group). Its column chunk is byte for byte the group's chunk in the shard (a page header
holds no absolute offset; checked here for every group, ``SidecarError`` if not), and its
footer, a ``FileMetaData`` of one row group whose chunk starts at byte 4, is the group's
*mini-footer*. So ``b"PAR1" + chunk + mini-footer + length + b"PAR1"`` is a parquet file that
pyarrow reads with every page's CRC verified (``decode_run``). The mini-footers are written
without the Arrow schema (pyarrow's ``ARROW:schema`` entry, 276 of their 469 bytes here):
it only restores the fixed-size list type, and the rows are reshaped from the values anyway.

The sidecar ``part-NNNNN.groups`` lies next to ``part-NNNNN.parquet``:

    header (16 bytes)  b"EGRP", u32 format (1), u32 row groups, u32 record width W
    record g at 16 + g * W, W bytes:
        u64 chunk offset in the shard, u64 chunk length, u32 mini-footer length, u32 rows,
        16 bytes of digest, the mini-footer, zero padding to W

All records of a shard have one width (the longest; they differ by a byte or two), so the
records of groups ``g .. g + c - 1`` are the bytes ``[16 + g*W, 16 + (g+c)*W)``: one ranged
GET with no lookup first (``records_span``). The digest is the first 16 bytes of the sha256
of the shard's sha256 (from the index), ``g``, the record's fields, the mini-footer and the
chunk's bytes: it verifies the mini-footer, the offsets and every byte of the chunk (page
headers too, which the page CRCs do not cover), and ties the record to this group of this
shard, so a record of another group, shard or corpus never passes.

Runs wherever shards are written (``elastic prepare``) or read (the host feeders and their
Ray Data read tasks). See docs/data.md, "What a host reads".
"""

from __future__ import annotations

import hashlib
import io
import struct
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic.ingest.index import Shard, sha256
from elastic.ingest.parquet_corpus import TOKENS
from elastic.ingest.shard_format import FOOTER_TAIL, encode_shard, footer_span, group_span, rows_of

MAGIC = b"EGRP"
FORMAT = 1
HEADER = struct.Struct("<4sIII")  # magic, format, row groups, record width
ENTRY = struct.Struct("<QQII16s")  # chunk offset, chunk length, mini-footer length, rows, digest
_SIGNED = struct.Struct("<IQQII")  # what the digest covers besides the bytes: g and the entry's fields
SUFFIX = ".groups"


class SidecarError(RuntimeError):
    """``elastic prepare`` could not write a sidecar that reads back as the shard (a parquet
    writer that puts absolute offsets in its pages, or one that changed its layout)."""


@dataclass(frozen=True)
class Record:
    """Row group ``group``'s sidecar record."""

    group: int
    offset: int  # of its column chunk in the shard
    length: int
    rows: int
    footer: bytes  # the mini-footer (a FileMetaData), without its length and magic
    digest: bytes


def sidecar_path(shard_path: str) -> str:
    """``part-00000.parquet`` -> ``part-00000.groups``."""
    return shard_path.rsplit(".", 1)[0] + SUFFIX


def record_digest(shard_sha256: str, g: int, offset: int, length: int, rows: int, footer: bytes, chunk: bytes) -> bytes:
    """Row group ``g``'s record digest (the module docstring)."""
    h = hashlib.sha256(bytes.fromhex(shard_sha256))
    h.update(_SIGNED.pack(g, offset, length, len(footer), rows))
    h.update(footer)
    h.update(chunk)
    return h.digest()[:16]


def mini_footer(rows: np.ndarray, chunk: bytes, where: str) -> bytes:
    """The footer of ``rows`` written alone as one row group, checked to frame ``chunk`` (the
    group's column chunk in the shard) exactly: ``SidecarError`` otherwise."""
    alone = encode_shard(rows, len(rows), store_schema=False)
    length = int.from_bytes(alone[-FOOTER_TAIL:-4], "little")
    footer = alone[len(alone) - FOOTER_TAIL - length : -FOOTER_TAIL]
    if alone[:4] != b"PAR1" or alone[4 : len(alone) - FOOTER_TAIL - length] != chunk:
        raise SidecarError(f"{where}: written alone, its column chunk differs from the shard's (not position-free)")
    meta = pq.read_metadata(pa.BufferReader(alone)).row_group(0)
    col = meta.column(0)
    if meta.num_rows != len(rows) or col.data_page_offset != 4 or col.total_compressed_size != len(chunk):
        raise SidecarError(f"{where}: written alone, its footer does not frame its chunk at byte 4")
    return footer


def encode_sidecar(shard: bytes, shard_sha256: str, rows: np.ndarray, rows_per_group: int, name: str) -> bytes:
    """The sidecar of ``shard`` (the bytes ``encode_shard(rows, rows_per_group)`` wrote)."""
    meta = pq.read_metadata(pa.BufferReader(shard))
    records = []
    for g in range(meta.num_row_groups):
        lo, hi = group_span(meta, g)
        part = rows[g * rows_per_group : (g + 1) * rows_per_group]
        if meta.row_group(g).num_rows != len(part):
            raise SidecarError(f"{name} row group {g}: {meta.row_group(g).num_rows} rows, {len(part)} expected")
        chunk = shard[lo:hi]
        footer = mini_footer(part, chunk, f"{name} row group {g}")
        digest = record_digest(shard_sha256, g, lo, hi - lo, len(part), footer, chunk)
        records.append(ENTRY.pack(lo, hi - lo, len(footer), len(part), digest) + footer)
    width = max(len(r) for r in records)
    body = b"".join(r.ljust(width, b"\0") for r in records)
    return HEADER.pack(MAGIC, FORMAT, len(records), width) + body


def shard_entry(name: str, rows: np.ndarray, rows_per_group: int) -> tuple[bytes, bytes, Shard]:
    """A shard's bytes, its sidecar's bytes and its (version 3) index entry."""
    data = encode_shard(rows, rows_per_group)
    digest = sha256(data)
    side = encode_sidecar(data, digest, rows, rows_per_group, name)
    off, length = footer_span(data)
    return (
        data,
        side,
        Shard(
            path=name,
            rows=len(rows),
            bytes=len(data),
            sha256=digest,
            footer_offset=off,
            footer_bytes=length,
            footer_sha256=sha256(data[off:]),
            rows_per_group=rows_per_group,
            groups_path=sidecar_path(name),
            groups_bytes=len(side),
            groups_record_bytes=HEADER.unpack(side[: HEADER.size])[3],
        ),
    )


def records_span(shard: Shard, first: int, count: int) -> tuple[int, int]:
    """``[start, end)`` bytes of the records of row groups ``first .. first + count - 1``."""
    width = int(shard.groups_record_bytes or 0)
    return HEADER.size + first * width, HEADER.size + (first + count) * width


def parse_records(blob: bytes, shard: Shard, first: int, count: int) -> list[Record]:
    """The records of groups ``first ..`` from ``records_span``'s bytes, checked for shape only
    (their digests are checked with the chunk's bytes, in ``decode_run``): the chunks lie in
    order inside the shard's data. ``OSError`` naming the shard otherwise."""
    width, name = int(shard.groups_record_bytes or 0), shard.path
    if width <= ENTRY.size or len(blob) != count * width:
        raise OSError(f"{name}: {len(blob)} bytes of sidecar records, {count} of {width} expected")
    out: list[Record] = []
    end = 4  # the shard's first chunk starts after its magic
    for i in range(count):
        at = i * width
        offset, length, flen, rows, digest = ENTRY.unpack_from(blob, at)
        g = first + i
        if flen > width - ENTRY.size or offset < end or offset + length > shard.bytes - FOOTER_TAIL or not rows:
            raise OSError(f"{name} row group {g}: its sidecar record is damaged (offsets out of place)")
        out.append(Record(g, offset, length, rows, bytes(blob[at + ENTRY.size : at + ENTRY.size + flen]), digest))
        end = offset + length
    return out


def chunks_span(records: list[Record]) -> tuple[int, int]:
    """``[start, end)`` bytes of the records' chunks in the shard: one ranged read."""
    return records[0].offset, records[-1].offset + records[-1].length


def decode_run(records: list[Record], start: int, blob: bytes, shard: Shard) -> np.ndarray:
    """The rows of the records' groups from the shard's bytes ``blob`` fetched at ``start``:
    each group's digest checked, then decoded from ``b"PAR1" + chunk + mini-footer + length +
    b"PAR1"`` with every page's CRC verified. ``OSError`` naming the shard otherwise."""
    parts = []
    for r in records:
        chunk = blob[r.offset - start : r.offset - start + r.length]
        if len(chunk) != r.length or record_digest(
            shard.sha256, r.group, r.offset, r.length, r.rows, r.footer, chunk
        ) != (r.digest):
            raise OSError(
                f"{shard.path} row group {r.group}: its bytes or its sidecar record ({shard.groups_path}) "
                "do not match their digest (damaged or replaced)"
            )
        alone = b"PAR1" + chunk + r.footer + len(r.footer).to_bytes(4, "little") + b"PAR1"
        try:
            pf = pq.ParquetFile(io.BytesIO(alone), page_checksum_verification=True)
            rows = rows_of(pf.read(columns=[TOKENS]).column(TOKENS))
        except (OSError, pa.ArrowException) as exc:
            raise OSError(f"{shard.path} row group {r.group}: {exc}") from exc
        if len(rows) != r.rows:
            raise OSError(f"{shard.path} row group {r.group}: {len(rows)} rows, {r.rows} expected")
        parts.append(rows)
    return np.concatenate(parts)


def read_sidecar(data: bytes, shard: Shard, shard_bytes: bytes) -> np.ndarray:
    """A whole sidecar and its shard's bytes read back through the records (for checks and
    tests): the shard's rows, every record verified."""
    magic, fmt, groups, width = HEADER.unpack_from(data)
    fits = width == shard.groups_record_bytes and len(data) == HEADER.size + groups * width
    if magic != MAGIC or fmt != FORMAT or not fits:
        raise OSError(f"{shard.groups_path}: not a row-group sidecar of format {FORMAT} for {shard.path}")
    records = parse_records(data[HEADER.size :], shard, 0, groups)
    return decode_run(records, 0, shard_bytes, shard)
