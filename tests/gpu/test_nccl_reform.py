"""The NCCL path of ``ReconfigurableProcessGroup``, on one GPU (world size 1).

What runs here: the group is NOT bound to the rank's device (bound, the second generation
in the same process crashed inside ``split_group`` on an H200: ``process_group._device_options``),
the job's secret-named store works with NCCL, a re-formation (leave, join the next
generation) works, and a shrink is refused where it cannot apply (an unbound group, gloo). What cannot run on one
GPU, nor anywhere here: ``shrink_group`` itself (it needs 2 ranks on 2 devices, and NCCL
refuses two ranks on one device), and a survivor's blocked collective aborted by it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_testlib import needs_cuda

from elastic.parallel.dims import ParallelDims
from elastic.worker.process_group import ReconfigurableProcessGroup, RendezvousStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.cluster,  # NCCL process groups
    pytest.mark.timeout(180),
    needs_cuda,
]


def test_nccl_group_is_bound_split_and_re_formed():
    torch.cuda.set_device(0)
    store = RendezvousStore("127.0.0.1", 60)
    group = ReconfigurableProcessGroup("cuda", 60)
    try:
        for generation in (1, 2):
            group.join(generation, 0, 1, store.address, store.secret)
            world = dist.group.WORLD
            assert dist.get_backend() == "nccl"
            # not bound: a bound group's second generation crashed in split_group (torch 2.11, H200)
            assert world.bound_device_id is None
            dims = ParallelDims(dp=1, tp=1, pp=1, world_size=1, timeout=group.rendezvous_timeout)
            dims.build_mesh("cuda")
            group.mesh_built(dims.mesh_groups())
            t = torch.ones(4, device="cuda")
            for g in dims.mesh_groups():
                dist.all_reduce(t, group=g)
            torch.cuda.synchronize()
            assert float(t.sum()) == 4.0
            assert not group.shrink((1,))  # unbound: re-formed, not shrunk
            del dims, t
            group.leave()
            assert not dist.is_initialized()
    finally:
        group.leave()
        store.close()
