"""Real DTensors on a 4-process gloo CPU mesh: save Shard(0), reshard on load."""

from __future__ import annotations

import pytest
import storage_gloo_worker

from elastic.testing.ranks import run_ranks
from storage import CheckpointStore

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(180)
def test_dtensor_save_and_reshard_across_meshes(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(4, storage_gloo_worker.run, (root,), tmp_path / "ranks")
    store = CheckpointStore(root)
    assert [i.step for i in store.list_committed()] == [1, 2]
    assert store.verify(1) == [] and store.verify(2) == []
    assert sorted(f for f in store.read_manifest(2).files if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
