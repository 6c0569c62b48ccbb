"""The ``cluster`` marker is enforced (``tests/cluster_guard.py``): in a test without it,
starting Ray, a ``Cluster``, a process group or a worker process fails the test at once."""

from __future__ import annotations

import multiprocessing

import cluster_guard
import pytest
import ray
import torch.distributed as dist
from ray.cluster_utils import Cluster

pytestmark = pytest.mark.timeout(60)

STARTS = {
    "ray.init": lambda: ray.init(address="local", num_cpus=1),
    "ray.cluster_utils.Cluster()": lambda: Cluster(initialize_head=True),
    "torch.distributed.init_process_group": lambda: dist.init_process_group("gloo", rank=0, world_size=1),
    "a worker process": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    "ray.init (Ray's auto-init)": lambda: ray.put(1),
}


@pytest.mark.parametrize("what", list(STARTS))
def test_an_unmarked_test_cannot_start_a_cluster(request, what):
    with pytest.raises(pytest.fail.Exception, match="not marked `cluster`"):
        STARTS[what]()
    assert not ray.is_initialized() and not dist.is_initialized()
    assert len(cluster_guard.failures(request.node)) == 1
    cluster_guard.failures(request.node).clear()  # caught on purpose: let this test pass


@pytest.mark.cluster
def test_a_marked_test_finds_the_real_entry_points():
    """Nothing is started: the guard is simply not installed."""
    for owner, name, _ in cluster_guard.entry_points():
        assert not hasattr(getattr(owner, name), "cluster_guard"), f"{owner}.{name} is still guarded"
