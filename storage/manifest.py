"""Manifest and commit-marker formats, and the checksum used everywhere.

Checksum: CRC-32 (``zlib.crc32``). The threat is accidental damage (bit flips, truncated or
partial uploads, a file from another attempt), not an adversary, and CRC-32 detects those
while running at several GB/s and releasing the GIL on large buffers, so it can be computed
inline while a background thread streams a snapshot out. SHA-256 would cost roughly 5-10x
more CPU on the training host for no gain against this threat model.

Layout of one checkpoint directory ``<root>/step_00000030/``::

    __0_0.distcp ...      DCP data files, one per writing rank (torch.save per chunk)
    __0_objects.json ...  plain-data objects per writing rank (JSON, never pickle)
    metadata.json         DCP metadata as plain JSON (what our reader uses)
    .metadata             the stock pickled DCP metadata, for stock tools only
    manifest.json         every file above with size + crc32, total bytes, extra
    COMMITTED             written last: {"step", "manifest_crc32", "total_bytes", ...}
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST = "manifest.json"
MARKER = "COMMITTED"
CHECKSUM = "crc32"
FORMAT = "elastic-ckpt/1"


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    return zlib.crc32(data, value) & 0xFFFFFFFF


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint, relative to its step directory."""

    relpath: str
    size: int
    crc32: int


@dataclass(frozen=True)
class Damage:
    """A file that failed verification, and why (``missing``, ``size ...``, ``crc32 ...``)."""

    relpath: str
    reason: str

    def __str__(self) -> str:
        return f"{self.relpath}: {self.reason}"


@dataclass
class Manifest:
    step: int
    files: dict[str, FileRecord]
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    checksum: str = CHECKSUM

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_bytes(self) -> bytes:
        body = {
            "format": self.format,
            "step": self.step,
            "created": self.created,
            "created_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            "checksum": self.checksum,
            "total_bytes": self.total_bytes,
            "files": {name: {"size": f.size, "crc32": f.crc32} for name, f in sorted(self.files.items())},
            "extra": self.extra,
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        body = json.loads(data)
        if body.get("format") != FORMAT or body.get("checksum") != CHECKSUM:
            raise ValueError(f"unknown manifest format {body.get('format')!r}/{body.get('checksum')!r}")
        files = {name: FileRecord(name, int(f["size"]), int(f["crc32"])) for name, f in body["files"].items()}
        return cls(step=int(body["step"]), files=files, created=float(body["created"]), extra=body.get("extra", {}))


@dataclass(frozen=True)
class Marker:
    """Content of ``COMMITTED``: pins the exact manifest it commits."""

    step: int
    manifest_crc32: int
    total_bytes: int
    committed_at: float

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Marker:
        body = json.loads(data)
        return cls(
            int(body["step"]), int(body["manifest_crc32"]), int(body["total_bytes"]), float(body["committed_at"])
        )
