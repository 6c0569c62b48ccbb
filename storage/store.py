"""Checkpoint directories with a commit protocol that is correct on object stores.

S3 has no atomic rename, so "write to tmp, rename" cannot publish a checkpoint. Instead a
checkpoint becomes visible in three ordered steps:

1. every rank streams its data files into ``step_XXXXXXXX/`` (invisible: no marker yet);
2. one process writes ``manifest.json`` (each file's size and crc32, total bytes, ``extra``);
3. the same process writes ``COMMITTED`` last; it names the manifest's crc32.

Readers (:meth:`CheckpointStore.list_committed`, :meth:`latest`) only trust directories with a
parseable marker, so a crash at any point before step 3 leaves nothing that looks good. A
single-object PUT is atomic on S3 and local writes are fsynced, so the marker either exists
whole or not at all. Deletion runs the protocol backwards: the marker goes first, so a
half-deleted checkpoint is merely uncommitted, never committed-but-damaged.
"""

from __future__ import annotations

import builtins
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from storage.errors import CheckpointNotFound, IncompleteCheckpoint, UnsafePath
from storage.fs import Storage, open_storage, redact, redact_uri
from storage.manifest import MANIFEST, MARKER, Damage, FileRecord, Manifest, Marker, crc32
from storage.retry import RetryPolicy, call_with_retry

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_SAFE_PART = re.compile(r"^[A-Za-z0-9_.+=@,-]+$")


def safe_relpath(relpath: object) -> bool:
    """A relative name of ``/``-separated parts, none empty, ``.`` or ``..``, each of plain
    characters (no backslash, colon, NUL or space): it cannot leave the directory it is
    joined to, on a file system or an object store."""
    if not isinstance(relpath, str) or not relpath:
        return False
    return all(part not in (".", "..") and _SAFE_PART.match(part) for part in relpath.split("/"))


_READ_BLOCK = 4 << 20


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``elastic ckpt list --json`` prints for one checkpoint."""

    step: int
    uri: str
    committed: bool
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PruneReport:
    deleted: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)


class CheckpointStore:
    """One directory per step under ``root_uri``; see the module docstring for the protocol."""

    def __init__(
        self,
        root_uri: str,
        storage: Storage | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ):
        self.root = root_uri.rstrip("/")
        self.storage: Storage = storage if storage is not None else open_storage(root_uri, storage_options)
        self.retry = retry or RetryPolicy()

    def __repr__(self) -> str:
        return f"CheckpointStore({redact_uri(self.root)!r})"

    # ----- paths -----
    def step_uri(self, step: int) -> str:
        return self.storage.join(self.root, f"step_{step:08d}")

    def file_uri(self, step: int, relpath: str) -> str:
        """The URI of ``relpath`` inside step ``step``'s directory; a name that could leave it
        (the names come from files a reader does not trust) is :class:`UnsafePath`."""
        if not safe_relpath(relpath):
            raise UnsafePath(relpath)
        step_uri = self.step_uri(step)
        if self.storage.is_link(step_uri):  # never followed out of the checkpoint directory
            raise UnsafePath(f"step_{step:08d}", "is a symbolic link: not a checkpoint of this directory")
        return self.storage.join(step_uri, relpath)

    # ----- reading the catalogue -----
    def list(self, include_uncommitted: bool = False) -> builtins.list[CheckpointInfo]:
        """Checkpoints sorted by step; uncommitted attempts only when asked for."""
        infos = []
        for name in self._retry(lambda: self.storage.ls(self.root), f"list {redact_uri(self.root)}"):
            match = _STEP_DIR.match(name)
            if not match:
                continue
            step = int(match.group(1))
            marker = self.read_marker(step)
            if marker is not None:
                infos.append(CheckpointInfo(step, self.step_uri(step), True, marker.total_bytes))
            elif include_uncommitted:
                size = sum(self.storage.sizes(self.step_uri(step)).values())
                infos.append(CheckpointInfo(step, self.step_uri(step), False, size))
        return sorted(infos, key=lambda i: i.step)

    def list_committed(self) -> builtins.list[CheckpointInfo]:
        return self.list(include_uncommitted=False)

    def latest(self) -> CheckpointInfo | None:
        committed = self.list_committed()
        return committed[-1] if committed else None

    def latest_valid(self, verify: bool = True) -> CheckpointInfo | None:
        """Newest committed checkpoint whose files all verify (crc32 when ``verify``, else sizes).

        Each damaged checkpoint that is skipped is logged as a warning naming its bad files.
        """
        for info in reversed(self.list_committed()):
            damage = self.verify(info.step, deep=verify)
            if not damage:
                return info
            log.warning(
                "checkpoint step %d at %s is damaged (%s); falling back to an older checkpoint",
                info.step,
                redact_uri(info.uri),
                "; ".join(map(str, damage)),
            )
        return None

    def read_marker(self, step: int) -> Marker | None:
        """The commit marker, or None if the step is not (or not properly) committed."""
        try:
            uri = self.file_uri(step, MARKER)
        except UnsafePath as exc:
            log.warning("ignoring %s under %s: %s", exc.relpath, redact_uri(self.root), exc.detail)
            return None
        try:
            marker = Marker.from_bytes(self._retry(lambda: self.storage.get_bytes(uri), f"read {MARKER}"))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, UnsafePath) as exc:  # UnsafePath: a link, a FIFO
            log.warning("ignoring unreadable commit marker %s: %s", redact_uri(uri), exc)
            return None
        return marker if marker.step == step else None

    def read_manifest(self, step: int) -> Manifest:
        if self.read_marker(step) is None:
            raise CheckpointNotFound(f"step {step} is not committed under {redact_uri(self.root)}")
        return Manifest.from_bytes(self.get_file(step, MANIFEST))

    def get_file(self, step: int, relpath: str, start: int | None = None, end: int | None = None) -> bytes:
        uri = self.file_uri(step, relpath)
        return self._retry(lambda: self.storage.get_bytes(uri, start, end), f"read {relpath}")

    # ----- verification -----
    def verify(self, step: int, *, deep: bool = True) -> builtins.list[Damage]:
        """Damaged files of ``step``: missing, wrong size, or (``deep``) wrong crc32."""
        damage: builtins.list[Damage] = []
        marker = self.read_marker(step)
        if marker is None:
            damage.append(Damage(MARKER, "missing or unreadable commit marker"))
        try:
            raw = self.get_file(step, MANIFEST)
            manifest = Manifest.from_bytes(raw)
        except FileNotFoundError:
            return damage + [Damage(MANIFEST, "missing")]
        except (ValueError, KeyError, TypeError, UnsafePath) as exc:
            return damage + [Damage(MANIFEST, f"unreadable: {exc}")]
        if marker is not None and crc32(raw) != marker.manifest_crc32:
            damage.append(Damage(MANIFEST, "crc32 does not match the commit marker"))
        present = self._retry(lambda: self.storage.sizes(self.step_uri(step)), "list checkpoint files")
        for rec in sorted(manifest.files.values(), key=lambda r: r.relpath):
            if not safe_relpath(rec.relpath):
                damage.append(Damage(rec.relpath, "names a path outside its checkpoint directory"))
            elif rec.relpath not in present:
                damage.append(Damage(rec.relpath, "missing"))
            elif present[rec.relpath] != rec.size:
                damage.append(Damage(rec.relpath, f"size {present[rec.relpath]} != {rec.size} in manifest"))
            elif deep and (actual := self._file_crc32(step, rec.relpath)) != rec.crc32:
                damage.append(Damage(rec.relpath, f"crc32 {actual:08x} != {rec.crc32:08x} in manifest"))
        return damage

    def _file_crc32(self, step: int, relpath: str) -> int:
        def run() -> int:
            value = 0
            with self.storage.open(self.file_uri(step, relpath), "rb") as f:
                while block := f.read(_READ_BLOCK):
                    value = crc32(block, value)
            return value

        return self._retry(run, f"checksum {relpath}")

    # ----- writing -----
    def put_file(self, step: int, relpath: str, data: bytes) -> FileRecord:
        """Write a small file in one piece (retried); returns its record for the manifest."""
        uri = self.file_uri(step, relpath)
        self._retry(lambda: self.storage.put_bytes(uri, data), f"write {relpath}")
        return FileRecord(relpath, len(data), crc32(data))

    def commit(self, step: int, files: Iterable[FileRecord], extra: dict[str, Any] | None = None) -> CheckpointInfo:
        """Publish ``step``: check the files are there, write the manifest, then the marker.

        Idempotent: committing an already committed step returns it unchanged. Credentials in
        ``extra`` are redacted before anything is written.
        """
        existing = self.read_marker(step)
        if existing is not None:
            log.info("step %d is already committed; keeping the first commit", step)
            return CheckpointInfo(step, self.step_uri(step), True, existing.total_bytes)
        records = {f.relpath: f for f in files}
        present = self._retry(lambda: self.storage.sizes(self.step_uri(step)), "list checkpoint files")
        wrong = sorted(r for r, f in records.items() if present.get(r) != f.size)
        if wrong:
            raise IncompleteCheckpoint(f"step {step}: files missing or of the wrong size before commit: {wrong}")
        manifest = Manifest(step=step, files=records, extra=redact(dict(extra or {})))
        body = manifest.to_bytes()
        self.put_file(step, MANIFEST, body)
        marker = Marker(step, crc32(body), manifest.total_bytes, time.time())
        self.put_file(step, MARKER, marker.to_bytes())
        log.info(
            "committed checkpoint step %d (%d files, %d bytes) at %s",
            step,
            len(records),
            manifest.total_bytes,
            redact_uri(self.step_uri(step)),
        )
        return CheckpointInfo(step, self.step_uri(step), True, manifest.total_bytes)

    # ----- deleting -----
    def abort(self, step: int) -> None:
        """Remove an uncommitted attempt (refuses to touch a committed checkpoint)."""
        if self.read_marker(step) is not None:
            raise ValueError(f"step {step} is committed; use prune() to delete committed checkpoints")
        self._retry(lambda: self.storage.rm(self.step_uri(step)), f"abort step {step}")

    def prune(self, keep: int, *, deep: bool = False) -> PruneReport:
        """Keep the newest ``keep`` committed checkpoints and the newest one that verifies.

        Also removes uncommitted attempts older than the newest commit (newer ones may still be
        uploading). Verification is by size unless ``deep``. Deletion failures are logged as
        errors and returned in ``PruneReport.failed``; they never stop the other deletions.
        """
        if keep < 1:
            raise ValueError("keep must be >= 1")
        infos = self.list(include_uncommitted=True)
        committed = [i for i in infos if i.committed]
        report = PruneReport()
        if not committed:
            return report
        retain = {i.step for i in committed[-keep:]}
        good = next((i for i in reversed(committed) if not self.verify(i.step, deep=deep)), None)
        if good is None:
            log.warning(
                "no committed checkpoint under %s verifies; pruning no committed checkpoint", redact_uri(self.root)
            )
            retain = {i.step for i in committed}
        else:
            retain.add(good.step)
        newest = committed[-1].step
        victims = [i for i in infos if (i.committed and i.step not in retain) or (not i.committed and i.step < newest)]
        for info in victims:
            try:
                if info.committed:  # un-commit first: a partial delete must not look committed
                    self._retry(lambda info=info: self.storage.rm(self.file_uri(info.step, MARKER)), "delete marker")
                self._retry(lambda info=info: self.storage.rm(info.uri), f"delete step {info.step}")
                report.deleted.append(info.step)
            except Exception as exc:  # noqa: BLE001 - reported, logged, and the loop goes on
                report.failed[info.step] = f"{type(exc).__name__}: {exc}"
                log.error(
                    "could not delete checkpoint step %d at %s: %s: %s",
                    info.step,
                    redact_uri(info.uri),
                    type(exc).__name__,
                    exc,
                )
        report.kept = sorted(retain)
        return report

    def _retry(self, fn, what: str):
        return call_with_retry(fn, self.retry, what)
