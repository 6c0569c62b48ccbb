"""Real DTensors on a 4-process gloo CPU mesh: save Shard(0), reshard on load."""

from __future__ import annotations

import socket

import pytest
import storage_gloo_worker
import torch.multiprocessing as mp

from storage import CheckpointStore


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_dtensor_save_and_reshard_across_meshes(tmp_path):
    root = str(tmp_path / "ckpt")
    mp.spawn(storage_gloo_worker.run, args=(4, _free_port(), root), nprocs=4, join=True)
    store = CheckpointStore(root)
    assert [i.step for i in store.list_committed()] == [1, 2]
    assert store.verify(1) == [] and store.verify(2) == []
    assert sorted(f for f in store.read_manifest(2).files if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
