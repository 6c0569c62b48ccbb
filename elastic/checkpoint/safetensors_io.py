"""The safetensors format over fsspec: headers, byte ranges of tensors, and streamed writes.

Runs on every rank that loads Hugging Face weights (``hf_import.py``) and in ``elastic ckpt
export`` (``export.py``). A safetensors file is an 8-byte little-endian header length, a
JSON header (``{name: {dtype, shape, data_offsets}}`` plus ``__metadata__``), then every
tensor's raw little-endian bytes. It is read here with ranged requests on any fsspec URI
(the ``safetensors`` package's ``safe_open``, which torch's own Hugging Face DCP reader
uses, needs a local file), so a rank fetches the bytes of its own slices only, and written
as a stream, one tensor at a time, so an export never holds the whole model in memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
# Contiguous rows of a column slice are fetched one range per row when a row's part is at
# least this large (or the file is local); smaller parts come with whole rows in one range.
MIN_SEGMENT = 1 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file and the absolute byte range of its data."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


# ``cat_file`` takes ``start``/``end`` by keyword: s3fs's third positional is a version id.


def read_header(fs: Any, path: str) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """Tensor entries, ``__metadata__`` and the header's size in bytes (what was fetched)."""
    size = int.from_bytes(fs.cat_file(path, start=0, end=8), "little")
    doc = json.loads(fs.cat_file(path, start=8, end=8 + size))
    meta = doc.pop("__metadata__", None) or {}
    entries = {}
    for name, info in doc.items():
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: {name} has dtype {info['dtype']}, which is not read here")
        begin, end = info["data_offsets"]
        entries[name] = TensorEntry(path, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + begin, 8 + size + end)
    return entries, meta, 8 + size


def decode(data: bytes | bytearray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(tuple(shape))


def read_rows(fs: Any, entry: TensorEntry, lo: int, hi: int, inner: Sequence[tuple[int, int]], local: bool):
    """Rows ``[lo, hi)`` of ``entry`` restricted to ``inner`` ((offset, length) per further
    dimension). Returns the tensor and the bytes fetched."""
    full_inner = all(o == 0 and n == d for (o, n), d in zip(inner, entry.shape[1:]))
    if len(entry.shape) == 2 and not full_inner:
        (col, width), item = inner[0], entry.dtype.itemsize
        if local or width * item >= MIN_SEGMENT:  # fetch only this slice of each row
            starts = [entry.begin + (r * entry.shape[1] + col) * item for r in range(lo, hi)]
            parts = _ranges(fs, entry.path, starts, width * item, local)
            return decode(b"".join(parts), entry.dtype, (hi - lo, width)), width * item * (hi - lo)
    if len(entry.shape) == 0:
        data = fs.cat_file(entry.path, start=entry.begin, end=entry.end)
        return decode(data, entry.dtype, ()), len(data)
    data = fs.cat_file(entry.path, start=entry.begin + lo * entry.row_bytes, end=entry.begin + hi * entry.row_bytes)
    rows = decode(data, entry.dtype, (hi - lo, *entry.shape[1:]))
    for dim, (offset, length) in enumerate(inner, start=1):
        rows = rows.narrow(dim, offset, length)
    return rows, len(data)


def _ranges(fs: Any, path: str, starts: list[int], length: int, local: bool) -> list[bytes]:
    if local:  # one open file, seek and read: no request per range
        with fs.open(path, "rb") as f:
            out = []
            for start in starts:
                f.seek(start)
                out.append(f.read(length))
            return out
    return fs.cat_ranges([path] * len(starts), starts, [s + length for s in starts])


# ----- writing --------------------------------------------------------------------------------


def header_bytes(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The header of a file holding ``tensors`` back to back in the given order (8-aligned)."""
    doc: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * dtype.itemsize
        doc[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_file(
    fs: Any,
    path: str,
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str],
) -> int:
    """Write one safetensors file, asking ``produce(name)`` for each tensor in turn; returns bytes."""
    written = 0
    with fs.open(path, "wb") as f:
        head = header_bytes(tensors, metadata)
        f.write(head)
        written += len(head)
        for name, dtype, shape in tensors:
            t = produce(name).detach().to("cpu", dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: produced {tuple(t.shape)}, declared {tuple(shape)}")
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            written += t.numel() * t.element_size()
    return written
