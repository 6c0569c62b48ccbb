"""The NCCL paths that one GPU can run (world size 1; NCCL refuses two ranks on one device).

* ``device_id`` at init binds the group to its GPU (eager communicator), and DeviceMesh then
  creates its sub-groups with ``split_group`` (one ``ncclCommSplit`` per mesh dimension)
  instead of a ``new_group`` per sub-group; the project's own group passes it (issue 29).
* Leaving a generation aborts its NCCL communicators, and the next generation forms in the
  same process (in-place recovery, the NCCL side of ``ReconfigurableProcessGroup.leave``).
* The NCCL backend supports ``shrink_group`` (gloo does not); shrinking itself needs two ranks.
* Non-blocking communicator initialisation, bounded by the init timeout.

What needs several GPUs (aborting survivors blocked in a collective with a lost peer,
shrinking a group around a lost rank) is written up in docs/gpu.md.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from gpu_testlib import needs_cuda

from elastic.parallel.dims import MESH_DIM_NAMES, ParallelDims

pytestmark = [pytest.mark.gpu, pytest.mark.cluster, needs_cuda, pytest.mark.timeout(120)]  # cluster: NCCL groups

TIMEOUT = datetime.timedelta(seconds=60)


def _init(**kwargs) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=TIMEOUT, **kwargs)


def _all_reduce_ones(group=None) -> float:
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t, group=group)
    return float(t.sum())


def _count_calls(monkeypatch) -> dict[str, int]:
    """Count DeviceMesh's ``split_group`` and ``new_group`` calls (both module globals there)."""
    import torch.distributed.device_mesh as device_mesh

    if not hasattr(device_mesh, "split_group"):
        pytest.skip("this torch's DeviceMesh never splits groups")
    calls = {"split_group": 0, "new_group": 0}
    for name in calls:
        real = getattr(device_mesh, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(device_mesh, name, counted)
    return calls


@pytest.mark.parametrize("bind", [True, False], ids=["device_id", "no_device_id"])
def test_device_id_makes_the_mesh_split_its_groups_from_the_parent(monkeypatch, bind):
    _init(**({"device_id": torch.device("cuda", 0)} if bind else {}))
    try:
        default = dist.distributed_c10d._get_default_group()
        assert (default.bound_device_id == torch.device("cuda", 0)) if bind else default.bound_device_id is None
        calls = _count_calls(monkeypatch)
        dims = ParallelDims(dp=1, tp=1, pp=1, world_size=1, timeout=TIMEOUT)
        dims.build_mesh("cuda")
        if bind:
            assert calls == {"split_group": len(MESH_DIM_NAMES), "new_group": 0}
        else:
            assert calls["split_group"] == 0 and calls["new_group"] >= len(MESH_DIM_NAMES)
        for name in MESH_DIM_NAMES:
            assert _all_reduce_ones(dims.world_mesh[name].get_group()) == 4.0
    finally:
        dist.destroy_process_group()


@pytest.mark.xfail(
    strict=True,
    reason="unbound on purpose: a device_id-bound group's second generation in the same process crashed "
    "in split_group (torch 2.11, H200, 2026-11-26); see process_group._device_options",
)
def test_the_projects_group_binds_its_gpu():
    from elastic.testing.single_rank import SingleRank

    rank = SingleRank("cuda")
    try:
        rank.join()
        assert dist.distributed_c10d._get_default_group().bound_device_id == torch.device("cuda", 0)
    finally:
        rank.close()


def test_leaving_aborts_nccl_and_the_next_generation_forms_in_the_same_process():
    from elastic.testing.single_rank import SingleRank

    rank = SingleRank("cuda", collective_timeout_s=30)
    try:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            dims = rank.join()
            for name in MESH_DIM_NAMES:  # a collective on every group: each communicator is made
                assert _all_reduce_ones(dims.world_mesh[name].get_group()) == 4.0
            assert _all_reduce_ones() == 4.0
            del dims
            rank.leave()  # NCCL: abort the communicators, then destroy the groups
            assert not dist.is_initialized()
            times.append(time.perf_counter() - t0)
        print(f"NCCL generation formed, used and aborted in {[round(t, 3) for t in times]} s")
        assert max(times[1:]) < 10.0
    finally:
        rank.close()


def test_the_nccl_backend_supports_shrinking():
    if not hasattr(dist, "shrink_group"):
        pytest.skip("this torch has no torch.distributed.shrink_group")
    _init(device_id=torch.device("cuda", 0))
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda", 0))
        assert getattr(backend, "supports_shrinking", False), "NCCL here cannot shrink (NCCL >= 2.27 needed)"
        with pytest.raises(ValueError, match="at least 2 ranks"):  # one GPU: nothing to shrink to
            dist.shrink_group([0])
    finally:
        dist.destroy_process_group()


def test_non_blocking_communicator_init_is_bounded_and_works():
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.blocking = 0
    t0 = time.perf_counter()
    _init(device_id=torch.device("cuda", 0), pg_options=opts)
    try:
        assert _all_reduce_ones() == 4.0
        took = time.perf_counter() - t0
        assert took < TIMEOUT.total_seconds()
        print(f"non-blocking NCCL init and a first all-reduce: {took:.3f} s")
    finally:
        dist.destroy_process_group()
