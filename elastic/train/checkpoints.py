"""A ``TorchTrainer`` run's checkpoints in storage: ``storage_path/name/checkpoint_NNNNNN/``
holds the files the ranks reported at report ``NNNNNN`` (merged, as Ray Train does), and
``storage_path/name/.elastic/checkpoint_NNNNNN.json`` commits it.

Each rank uploads its own files in the background (``upload_part``: every file written,
then its size read back from storage and its SHA-256 kept); the driver writes the commit
record once every part of that report is uploaded (``commit``): the files' manifest (size
and digest each), the report's metrics and the loaders' data positions. The record is
written last, so a checkpoint without one is never read: a crash mid-upload leaves nothing
that a rerun would restore. ``read_committed`` checks every file against the manifest.
``prune`` keeps ``num_to_keep`` (the record first, then the files).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from storage.fs import open_storage

RECORDS = ".elastic"
_NAME = re.compile(r"^checkpoint_(\d{6,})\.json$")


def checkpoint_dir(run_dir: str, index: int) -> str:
    return f"{run_dir.rstrip('/')}/checkpoint_{index:06d}"


def _record(run_dir: str, index: int) -> str:
    return f"{run_dir.rstrip('/')}/{RECORDS}/checkpoint_{index:06d}.json"


def upload_part(run_dir: str, index: int, files: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    """Write one rank's files of checkpoint ``index``; their manifest, read back from storage."""
    storage = open_storage(run_dir, None)
    base = checkpoint_dir(run_dir, index)
    manifest = {}
    for rel, data in files.items():
        rel = _inside(rel)
        uri = storage.join(base, rel)
        storage.put_bytes(uri, data)
        size = storage.size(uri)
        if size != len(data):
            raise OSError(f"{uri}: {size} bytes in storage after writing {len(data)}")
        manifest[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return manifest


def _inside(rel: str) -> str:
    """A file's name inside the checkpoint, refused when it would leave the directory."""
    parts = rel.replace("\\", "/").split("/")
    if rel.startswith(("/", "\\")) or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"checkpoint file {rel!r} would leave the checkpoint directory")
    return "/".join(parts)


def commit(run_dir: str, index: int, manifest: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    storage = open_storage(run_dir, None)
    record = {"index": index, "files": manifest, **meta}
    storage.put_bytes(_record(run_dir, index), json.dumps(record, sort_keys=True).encode())
    return checkpoint_dir(run_dir, index)


def committed(run_dir: str) -> list[dict[str, Any]]:
    """Every committed checkpoint's record, oldest first (unreadable records are skipped)."""
    storage = open_storage(run_dir, None)
    records = []
    for name in storage.ls(f"{run_dir.rstrip('/')}/{RECORDS}"):
        if not _NAME.match(name):
            continue
        try:
            records.append(json.loads(storage.get_bytes(f"{run_dir.rstrip('/')}/{RECORDS}/{name}")))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: int(r["index"]))


def read_committed(path: str) -> dict[str, bytes]:
    """The files of the committed checkpoint at ``path``, each checked against its record."""
    run_dir, _, name = path.rstrip("/").rpartition("/")
    index = int(name.removeprefix("checkpoint_"))
    storage = open_storage(run_dir, None)
    record = json.loads(storage.get_bytes(_record(run_dir, index)))
    files = {}
    for rel, want in record["files"].items():
        data = storage.get_bytes(storage.join(path, rel))
        if len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
            raise OSError(f"checkpoint {index}: {rel} does not match its record (damaged)")
        files[rel] = data
    return files


def prune(run_dir: str, keep: list[int]) -> list[int]:
    """Delete the committed checkpoints not in ``keep``; the ones deleted."""
    storage = open_storage(run_dir, None)
    gone = []
    for record in committed(run_dir):
        index = int(record["index"])
        if index in keep:
            continue
        storage.rm(_record(run_dir, index))
        storage.rm(checkpoint_dir(run_dir, index))
        gone.append(index)
    return gone
