"""Sharded DCP save/commit/load: resharding, bytes read, checksums, in-memory snapshots."""

from __future__ import annotations

import math
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from storage_testlib import (
    WORLD,
    assemble,
    assert_same_objects,
    model_and_optimizer_state,
    overlap_bytes,
    rank_snapshot,
    save_sharded,
    target,
)

from storage import (
    CheckpointNotFound,
    CheckpointStore,
    ChecksumMismatch,
    IncompleteCheckpoint,
    LayoutMismatch,
    ShardRecord,
    SnapshotReader,
    codec,
    commit_checkpoint,
    cpu_snapshot,
    load_into,
    write_rank_shard,
)

STEP = 100


@pytest.fixture(scope="module")
def state():
    return model_and_optimizer_state()


@pytest.fixture
def saved(tmp_path, state):
    """The model + AdamW state written by 4 FSDP-like ranks (dim-0 ShardRecords)."""
    tensors, objects = state
    store = CheckpointStore(str(tmp_path / "ckpt"))
    results = save_sharded(store, STEP, tensors, objects)
    commit_checkpoint(store, STEP, results, extra={"dp": WORLD})
    return store, results


@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_reshard_4_to_n_reproduces_full_state(saved, state, new_world):
    store, _ = saved
    tensors, objects = state
    targets = [target(tensors, r, new_world) for r in range(new_world)]
    for t in targets:
        out = load_into(store, t)
        assert_same_objects(out.objects, objects)
    for fqn, full in tensors.items():
        assert torch.equal(assemble(targets, fqn), full), fqn


def test_replicated_entries_written_once(saved, state):
    _, results = saved
    tensors, _ = state
    replicated = sorted(k for k, v in tensors.items() if v.dim() == 0)
    assert replicated and all(k.endswith(".step") for k in replicated)
    for res in results:
        written = {c.fqn for c in res.chunks if c.sizes == ()}
        assert sorted(written) == (replicated if res.rank == 0 else [])
        assert (res.objects != []) == (res.rank == 0)


def test_bytes_read_follow_the_requested_boxes(saved, state):
    store, results = saved
    tensors, _ = state
    manifest = store.read_manifest(STEP)
    data_total = sum(f.size for name, f in manifest.files.items() if name.endswith(".distcp"))
    full = {k: torch.empty_like(v) for k, v in tensors.items()}
    assert load_into(store, full).data_bytes_read == data_total
    # one rank of a 2-way layout needs exactly the boxes of old ranks 0 and 1
    half = load_into(store, target(tensors, 0, 2))
    # one rank of a 2-way layout reads only the saved boxes that overlap its own boxes
    needed = {
        (c.fqn, c.offsets)
        for res in results
        for c in res.chunks
        if c.sizes == () or c.offsets[0] < -(-c.global_shape[0] // 2)
    }
    expected = sum(c.length for res in results for c in res.chunks if (c.fqn, c.offsets) in needed)
    assert half.data_bytes_read == expected
    assert half.data_bytes_read < 0.65 * data_total
    assert half.bytes_read > half.data_bytes_read  # metadata + objects are counted too
    # a single small tensor reads about its own size, not the checkpoint
    one = load_into(store, {"model.3.bias": torch.empty(10)})
    assert one.data_bytes_read < 10 * 4 + 4 * 2048


def test_corrupt_box_fails_the_load_with_the_file_named(saved, state):
    store, results = saved
    tensors, _ = state
    box = next(c for c in results[2].chunks if c.fqn == "model.0.weight")
    path = os.path.join(store.step_uri(STEP), box.file)
    with open(path, "r+b") as f:
        f.seek(box.offset + box.length - 3)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ChecksumMismatch, match="__2_0.distcp"):
        load_into(store, {"model.0.weight": torch.empty_like(tensors["model.0.weight"])})
    ok = {"model.1.weight": torch.empty_like(tensors["model.1.weight"])}  # other boxes still load
    load_into(store, ok)
    assert torch.equal(ok["model.1.weight"], tensors["model.1.weight"])


def test_loader_never_unpickles_storage(saved, state, tmp_path):
    store, _ = saved
    tensors, _ = state
    canary = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    with open(os.path.join(store.step_uri(STEP), ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    full = {k: torch.empty_like(v) for k, v in tensors.items()}
    load_into(store, full)
    assert not canary.exists()
    assert all(torch.equal(full[k], tensors[k]) for k in tensors)


def test_stock_dcp_reader_loads_our_checkpoint(saved, state):
    store, _ = saved
    tensors, _ = state
    full = {k: torch.zeros_like(v) for k, v in tensors.items()}
    with pytest.warns(UserWarning):  # dcp.load warns without a process group
        dcp.load(full, storage_reader=dcp.FileSystemReader(store.step_uri(STEP)), no_dist=True)
    assert all(torch.equal(full[k], tensors[k]) for k in tensors)


def test_commit_refuses_a_missing_rank(tmp_path, state):
    tensors, objects = state
    store = CheckpointStore(str(tmp_path / "ckpt"))
    results = save_sharded(store, 1, tensors, objects)
    with pytest.raises(IncompleteCheckpoint, match="cover"):
        commit_checkpoint(store, 1, results[:3])
    assert store.list_committed() == []
    commit_checkpoint(store, 1, [type(r).from_dict(r.to_dict()) for r in results])  # plain data round trip
    assert [i.step for i in store.list_committed()] == [1]


def test_only_committed_steps_load(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointNotFound):
        load_into(store, {"w": torch.empty(4)})
    write_rank_shard(store, 3, {"w": torch.ones(4)}, 0)  # uploaded, never committed
    with pytest.raises(CheckpointNotFound):
        load_into(store, {"w": torch.empty(4)}, step=3)


def test_layout_errors_are_typed(saved, state):
    store, _ = saved
    with pytest.raises(LayoutMismatch, match="not in the checkpoint"):
        load_into(store, {"nope": torch.empty(3)})
    with pytest.raises(LayoutMismatch, match="shape"):
        load_into(store, {"model.3.bias": torch.empty(11)})
    out = load_into(store, {"nope": torch.empty(3)}, strict=False)
    assert out.data_bytes_read == 0


def test_snapshot_reader_reshards_in_memory(state):
    tensors, objects = state
    snaps = {r: rank_snapshot(tensors, objects, r) for r in range(WORLD)}
    targets = [target(tensors, r, 2) for r in range(2)]
    for r, t in enumerate(targets):
        reader = SnapshotReader(snaps, prefer_rank=2 * r)
        out = load_into(reader, t)
        assert_same_objects(out.objects, objects)
        want = overlap_bytes(tensors, WORLD, 2, r)
        want[2 * r] += sum(v.numel() * v.element_size() for v in tensors.values() if v.dim() == 0)
        assert reader.bytes_by_rank == want  # replicated entries come from the preferred rank
    for fqn, full in tensors.items():
        assert torch.equal(assemble(targets, fqn), full), fqn


def test_sources_for_plans_from_meta_layouts(state):
    tensors, objects = state
    layouts = {
        r: {
            k: (
                ShardRecord(v.local.to("meta"), v.global_shape, v.offsets)
                if isinstance(v, ShardRecord)
                else v.to("meta")
            )
            for k, v in rank_snapshot(tensors, {}, r).items()
        }
        for r in range(WORLD)
    }
    need = SnapshotReader(layouts, prefer_rank=3).sources_for(target(tensors, 1, 2))
    want = overlap_bytes(tensors, WORLD, 2, 1)
    want[3] += sum(v.numel() * v.element_size() for v in tensors.values() if v.dim() == 0)
    assert need == want and set(want) == {1, 2, 3}
    with pytest.raises(IncompleteCheckpoint):  # old rank 3 is gone: its box cannot be served
        load_into(SnapshotReader({r: layouts[r] for r in range(3)}), target(tensors, 1, 2))


def test_codec_round_trip_known_answer():
    value = {
        "t": (1, 2.5, None),
        3: "int key",
        "nan": float("nan"),
        "inf": float("-inf"),
        "x": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "b": torch.tensor([True, False]),
        "e": torch.empty(0, 4),
        "nested": [{"__tuple__": "not a tag"}],
        "s": torch.tensor(7),
    }
    back = codec.decode(__import__("json").loads(codec.dumps(codec.encode(value))))
    assert back["t"] == (1, 2.5, None) and back[3] == "int key" and back["inf"] == float("-inf")
    assert math.isnan(back["nan"]) and back["nested"] == [{"__tuple__": "not a tag"}]
    for k in ("x", "b", "e", "s"):
        assert back[k].dtype == value[k].dtype and torch.equal(back[k], value[k])
    with pytest.raises(TypeError, match="opt"):
        codec.encode({"opt": object()})


def test_cpu_snapshot_copies_and_assigns_writers():
    w, step = torch.arange(6.0), torch.tensor(3.0)

    def state(rank):
        return {"w": w, "step": step, "cursor": cursor, f"rng.rank{rank}": {"cpu": torch.zeros(3)}}

    cursor = {"offsets": [1, 2]}
    snap0, owned0 = cpu_snapshot(state(0), 0, rank_local=["rng.rank0"])
    snap1, owned1 = cpu_snapshot(state(1), 1, rank_local=["rng.rank1"])
    w.add_(100)  # training goes on after the snapshot
    cursor["offsets"].append(3)
    assert torch.equal(snap0["w"], torch.arange(6.0)) and snap0["cursor"] == {"offsets": [1, 2]}
    assert owned0 == {"w", "step", "cursor", "rng.rank0"} and owned1 == {"rng.rank1"}


def _forge(store, edit) -> None:
    """Edit ``metadata.json`` (or the manifest) of STEP and fix every checksum up, as an
    attacker with write access to the checkpoint would: the commit chain still verifies."""
    import json

    from storage.manifest import FileRecord, Manifest, Marker, crc32

    step_dir = store.step_uri(STEP)
    meta_path = os.path.join(step_dir, "metadata.json")
    doc = json.load(open(meta_path))
    raw_manifest = open(os.path.join(step_dir, "manifest.json"), "rb").read()
    manifest = Manifest.from_bytes(raw_manifest)
    edit(doc, manifest)
    body = json.dumps(doc, sort_keys=True).encode()
    open(meta_path, "wb").write(body)
    manifest.files["metadata.json"] = FileRecord("metadata.json", len(body), crc32(body))
    raw_manifest = manifest.to_bytes()
    open(os.path.join(step_dir, "manifest.json"), "wb").write(raw_manifest)
    marker = Marker.from_bytes(open(os.path.join(step_dir, "COMMITTED"), "rb").read())
    marker = Marker(marker.step, crc32(raw_manifest), manifest.total_bytes, marker.committed_at)
    open(os.path.join(step_dir, "COMMITTED"), "wb").write(marker.to_bytes())


@pytest.mark.parametrize("outside", ["../../outside.distcp", "/abs/outside.distcp", "sub/../../outside.distcp"])
def test_a_metadata_path_that_leaves_the_checkpoint_is_never_opened(saved, state, tmp_path, outside):
    """A box's ``file`` forged to point outside the step directory (checksums fixed up, and
    the outside file a byte-exact copy, so a reader that followed it would load cleanly) is
    refused as damage naming the path; issue 48: the worker used to open it."""
    from storage.errors import UnsafePath

    store, results = saved
    tensors, _ = state
    box = next(c for c in results[2].chunks if c.fqn == "model.0.weight")
    real = os.path.join(store.step_uri(STEP), box.file)
    copy = os.path.normpath(os.path.join(store.step_uri(STEP), "../../outside.distcp"))
    open(copy, "wb").write(open(real, "rb").read())

    def point_outside(doc, manifest):
        for chunk in doc["tensors"]["model.0.weight"]["chunks"]:
            if chunk["file"] == box.file:
                chunk["file"] = outside

    _forge(store, point_outside)
    with pytest.raises(UnsafePath, match="outside its checkpoint directory"):
        load_into(store, {"model.0.weight": torch.empty_like(tensors["model.0.weight"])})
    assert isinstance(pickle.loads(pickle.dumps(UnsafePath(outside))), UnsafePath)  # crosses actors whole


def test_a_manifest_entry_that_leaves_the_checkpoint_is_damage(saved):
    store, _ = saved

    def add_outside(doc, manifest):
        from storage.manifest import FileRecord

        manifest.files["../../etc/passwd"] = FileRecord("../../etc/passwd", 1, 0)

    _forge(store, add_outside)
    damage = store.verify(STEP)
    assert [d.relpath for d in damage] == ["../../etc/passwd"], damage
    assert "outside its checkpoint directory" in damage[0].reason


def test_storage_errors_survive_pickling_with_their_fields():
    """Ray re-raises a worker's exception in the driver by pickling it; a type that could not
    be rebuilt from its args arrived as "Failed to deserialize exception"."""
    from storage import StorageUnavailable

    err = pickle.loads(pickle.dumps(ChecksumMismatch("a.distcp", "fails its crc32")))
    assert (err.relpath, err.detail, str(err)) == ("a.distcp", "fails its crc32", "a.distcp: fails its crc32")
    un = pickle.loads(pickle.dumps(StorageUnavailable("read x", 3, 1.5, OSError("down"))))
    assert (un.what, un.attempts, un.elapsed_s) == ("read x", 3, 1.5) and "down" in str(un)
