"""Real DTensors on a 4-process gloo CPU mesh: save Shard(0), reshard on load."""

from __future__ import annotations

import pytest
import storage_gloo_worker
import torch.multiprocessing as mp

from elastic.testing.ports import free_port as _free_port
from storage import CheckpointStore


@pytest.mark.timeout(180)
def test_dtensor_save_and_reshard_across_meshes(tmp_path):
    root = str(tmp_path / "ckpt")
    mp.spawn(storage_gloo_worker.run, args=(4, _free_port(), root), nprocs=4, join=True)
    store = CheckpointStore(root)
    assert [i.step for i in store.list_committed()] == [1, 2]
    assert store.verify(1) == [] and store.verify(2) == []
    assert sorted(f for f in store.read_manifest(2).files if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
