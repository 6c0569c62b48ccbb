"""Commit protocol, verification, fallback and retention of CheckpointStore (local disk)."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch

from storage import (
    CheckpointStore,
    FsspecStorage,
    IncompleteCheckpoint,
    commit_checkpoint,
    load_into,
    open_storage,
    write_rank_shard,
)
from storage.errors import UnsafePath
from storage.manifest import MANIFEST, MARKER, Manifest


def save(store: CheckpointStore, step: int, ranks: int = 2) -> None:
    results = [write_rank_shard(store, step, {"w": torch.full((256,), float(step)) + r}, r) for r in range(1)]
    results += [write_rank_shard(store, step, {f"r{r}": torch.arange(64.0) * step}, r) for r in range(1, ranks)]
    commit_checkpoint(store, step, results, extra={"note": f"step {step}"})


def corrupt_byte(path: str, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(str(tmp_path / "ckpt"))


def test_only_committed_checkpoints_are_listed(store):
    save(store, 10)
    # crash after the data files, before the manifest
    write_rank_shard(store, 20, {"w": torch.ones(8)}, 0)
    # crash after the manifest, before the marker
    res = write_rank_shard(store, 30, {"w": torch.ones(8)}, 0)
    store.put_file(30, MANIFEST, Manifest(step=30, files={f.relpath: f for f in res.files}).to_bytes())
    # a torn marker (e.g. a crash while writing it on a local disk) is not a commit either
    write_rank_shard(store, 40, {"w": torch.ones(8)}, 0)
    store.put_file(40, MARKER, b'{"step": 4')

    assert [i.step for i in store.list_committed()] == [10]
    assert store.latest().step == 10
    everything = store.list(include_uncommitted=True)
    assert [(i.step, i.committed) for i in everything] == [(10, True), (20, False), (30, False), (40, False)]
    assert everything[0].bytes == Manifest.from_bytes(store.get_file(10, MANIFEST)).total_bytes > 0
    assert everything[0].to_dict() == {
        "step": 10,
        "uri": store.step_uri(10),
        "committed": True,
        "bytes": everything[0].bytes,
    }
    assert everything[1].bytes == os.path.getsize(os.path.join(store.step_uri(20), "__0_0.distcp"))


class WriteOrder(FsspecStorage):
    """Real local storage that remembers the order in which files were finished."""

    def __init__(self, inner: FsspecStorage):
        super().__init__(inner.fs)
        self.finished: list[str] = []

    def open(self, uri, mode="rb"):
        ctx = super().open(uri, mode)
        if mode == "wb":

            class Recorder:
                def __enter__(_):
                    return ctx.__enter__()

                def __exit__(_, *exc):
                    out = ctx.__exit__(*exc)
                    self.finished.append(uri.rsplit("/", 1)[-1])
                    return out

            return Recorder()
        return ctx


def test_commit_writes_data_then_manifest_then_marker(tmp_path):
    storage = WriteOrder(open_storage(str(tmp_path)))
    save(CheckpointStore(str(tmp_path / "ckpt"), storage), 1)
    assert storage.finished[-2:] == [MANIFEST, MARKER]
    assert set(storage.finished[:-2]) == {"__0_0.distcp", "__1_0.distcp", "metadata.json", ".metadata"}


def test_manifest_records_every_file_with_crc32(store):
    save(store, 5)
    manifest = store.read_manifest(5)
    on_disk = sorted(n for n in os.listdir(store.step_uri(5)) if n not in (MANIFEST, MARKER))
    assert sorted(manifest.files) == on_disk == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
    assert all(manifest.files[n].size == os.path.getsize(os.path.join(store.step_uri(5), n)) for n in on_disk)
    assert manifest.extra == {"note": "step 5"} and manifest.checksum == "crc32"


def test_commit_refuses_missing_files(store):
    res = write_rank_shard(store, 7, {"w": torch.ones(8)}, 0)
    os.remove(os.path.join(store.step_uri(7), "__0_0.distcp"))
    with pytest.raises(IncompleteCheckpoint, match="__0_0.distcp"):
        store.commit(7, res.files)
    assert store.list_committed() == []


def test_corrupt_byte_is_named_and_latest_valid_falls_back(store, caplog):
    save(store, 1)
    save(store, 2)
    corrupt_byte(os.path.join(store.step_uri(2), "__1_0.distcp"))
    damage = store.verify(2)
    assert [d.relpath for d in damage] == ["__1_0.distcp"] and "crc32" in damage[0].reason
    assert store.verify(2, deep=False) == []  # same size: only the checksum can tell
    assert store.verify(1) == []
    with caplog.at_level(logging.WARNING, logger="storage"):
        assert store.latest_valid().step == 1
    assert any("__1_0.distcp" in r.getMessage() and "step 2" in r.getMessage() for r in caplog.records)
    assert store.latest().step == 2  # latest() alone does not verify


def test_truncated_and_missing_files_are_damage(store):
    save(store, 3)
    with open(os.path.join(store.step_uri(3), "__0_0.distcp"), "r+b") as f:
        f.truncate(10)
    os.remove(os.path.join(store.step_uri(3), "metadata.json"))
    damage = {d.relpath: d.reason for d in store.verify(3, deep=False)}
    assert damage == {"__0_0.distcp": damage["__0_0.distcp"], "metadata.json": "missing"}
    assert damage["__0_0.distcp"].startswith("size 10 != ")


def test_prune_keeps_newest_and_cleans_old_leftovers(store):
    for step in (1, 2, 3, 4):
        save(store, step)
    write_rank_shard(store, 0, {"w": torch.ones(4)}, 0)  # stale attempt: older than a commit
    write_rank_shard(store, 9, {"w": torch.ones(4)}, 0)  # may still be uploading: keep
    report = store.prune(keep=2)
    assert sorted(report.deleted) == [0, 1, 2] and report.failed == {} and report.kept == [3, 4]
    assert [(i.step, i.committed) for i in store.list(include_uncommitted=True)] == [(3, True), (4, True), (9, False)]
    t = {"w": torch.empty(256)}
    load_into(store, t, step=3)
    assert torch.equal(t["w"], torch.full((256,), 3.0))


def test_prune_never_deletes_the_only_good_checkpoint(store):
    for step in (1, 2, 3):
        save(store, step)
    with open(os.path.join(store.step_uri(3), "__0_0.distcp"), "r+b") as f:
        f.truncate(5)
    report = store.prune(keep=1)
    assert report.deleted == [1] and report.kept == [2, 3]
    assert [i.step for i in store.list_committed()] == [2, 3]
    corrupt_byte(os.path.join(store.step_uri(2), "__0_0.distcp"))  # only a deep check sees this
    assert store.prune(keep=1, deep=True).deleted == []  # nothing verifies: delete nothing


def _make_undeletable(path: str) -> bool:
    """A real deletion failure: immutable file (root) or read-only directory (non-root)."""
    if os.geteuid() == 0:
        return subprocess.run(["chattr", "+i", path], capture_output=True).returncode == 0
    os.chmod(os.path.dirname(path), 0o555)
    return True


def _undo(path: str) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", path], capture_output=True)
    else:
        os.chmod(os.path.dirname(path), 0o755)


def test_prune_reports_and_logs_deletion_failures(store, caplog):
    for step in (1, 2, 3):
        save(store, step)
    stuck = os.path.join(store.step_uri(1), "__0_0.distcp")
    if not _make_undeletable(stuck):
        pytest.skip("cannot make a file undeletable on this filesystem")
    try:
        with caplog.at_level(logging.WARNING, logger="storage"):
            report = store.prune(keep=1)
    finally:
        _undo(stuck)
    assert report.deleted == [2] and list(report.failed) == [1]
    assert "PermissionError" in report.failed[1]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "step 1" in r.getMessage()]
    assert errors, "a failed deletion must be logged"
    # the marker went first, so the half-deleted checkpoint is not taken for a good one
    assert [i.step for i in store.list_committed()] == [3]
    assert store.prune(keep=1).deleted == [1]  # cleaned as a leftover once deletable


def test_abort_removes_uncommitted_only(store):
    save(store, 1)
    write_rank_shard(store, 2, {"w": torch.ones(4)}, 0)
    store.abort(2)
    assert not os.path.exists(store.step_uri(2))
    with pytest.raises(ValueError):
        store.abort(1)
    assert store.latest().step == 1


def test_nothing_is_followed_out_of_a_checkpoint_directory(store, tmp_path):
    """A step directory that is a symbolic link to another run's committed checkpoint is no
    checkpoint here: never listed, so retention never deletes its marker through the link; a
    link or a FIFO inside a checkpoint is refused (a file missing: damage), and a FIFO as the
    commit marker reads as no marker at once instead of blocking the reader."""
    other = CheckpointStore(str(tmp_path / "other"))
    save(other, 1)
    os.makedirs(store.root)
    os.symlink(other.step_uri(1), store.step_uri(1))
    for step in (2, 3):
        save(store, step)
    assert [i.step for i in store.list(include_uncommitted=True)] == [2, 3]
    report = store.prune(1)
    assert report.deleted == [2] and report.kept == [3]
    assert other.read_marker(1) is not None and not other.verify(1)  # the link's target untouched
    store.abort(1)  # removes the link alone
    assert not os.path.lexists(store.step_uri(1)) and other.read_marker(1) is not None

    name = sorted(store.storage.sizes(store.step_uri(3)))[0]
    target = store.file_uri(3, name)
    os.replace(target, str(tmp_path / "moved"))
    os.symlink(str(tmp_path / "moved"), target)
    assert [d.relpath for d in store.verify(3)] == [name]
    with pytest.raises(UnsafePath):
        store.get_file(3, name)

    os.makedirs(store.step_uri(4))
    os.mkfifo(store.file_uri(4, MARKER))
    os.mkfifo(store.file_uri(3, "x.fifo"))
    assert store.read_marker(4) is None
    assert {"x.fifo", name} <= set(os.listdir(store.step_uri(3)))
    assert store.storage.ls(store.step_uri(3)) == sorted(set(os.listdir(store.step_uri(3))) - {"x.fifo", name})
