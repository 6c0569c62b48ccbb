"""Every private torch name the elastic runtime relies on still exists.

They are listed in ``elastic/worker/private_torch.py``, each with its user. A torch upgrade
that moves one fails here, by name, instead of as a hang or a wrong result in the middle of
a recovery.
"""

from __future__ import annotations

import importlib

import pytest

from elastic.worker.private_torch import PRIVATE_TORCH_API

pytestmark = pytest.mark.timeout(60)


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("name", PRIVATE_TORCH_API)
def test_private_name_exists(name):
    assert _resolve(name) is not None


def test_dtensor_sharding_caches_can_be_cleared():
    """Leaving a group clears DTensor's sharding-propagation caches, which key on meshes."""
    propagator = _resolve("torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator")
    caches = [getattr(propagator, n, None) for n in ("propagate_op_sharding", "_propagate_tensor_meta_cached")]
    assert any(hasattr(c, "cache_clear") for c in caches)


def test_mesh_stack_is_a_list():
    stack = _resolve("torch.distributed.device_mesh._mesh_resources.mesh_stack")
    assert isinstance(stack, list)


def test_gloo_options_take_a_timeout():
    import datetime

    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=5)
    assert opts._timeout == datetime.timedelta(seconds=5)


def test_group_counter_names_the_default_group():
    """The default group's name (its store-key prefix) comes from torch's group counter,
    which a half-failed join leaves advanced; the worker resets it before joining."""
    from torch.distributed import distributed_c10d as c10d

    before = c10d._world.group_count
    try:
        c10d._world.group_count = 3
        assert c10d._process_group_name([], use_hashed_name=False) == "3"
        assert c10d._world.group_count == 4
    finally:
        c10d._world.group_count = before


@pytest.mark.cluster  # an in-process process group (the fake backend: no peers, no sockets)
def test_a_dtensor_made_with_its_parameters_spec_is_the_one_from_local_makes():
    """``elastic.parallel.live.dtensor_like`` wraps a kept shard with its parameter's own spec
    (``DTensor(local, spec, requires_grad=...)``, FSDP2's own shortcut) instead of
    ``DTensor.from_local``: the same DTensor, or a torch upgrade changed the constructor."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from elastic.parallel.live import dtensor_like

    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        placements = (Replicate(), Shard(0))
        param = DTensor.from_local(torch.randn(3, 8), mesh, placements, run_check=False, shape=(6, 8), stride=(8, 1))
        kept = torch.randn(3, 8)
        fast, slow = (
            dtensor_like(kept, param),
            DTensor.from_local(kept, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()),
        )
        assert fast._spec == slow._spec and fast.to_local().data_ptr() == kept.data_ptr() and not fast.requires_grad
        assert (fast.shape, fast.stride(), fast.placements) == (torch.Size([6, 8]), (8, 1), placements)
        other = dtensor_like(kept.to(torch.float64), param)  # another dtype: through from_local
        assert other.dtype == torch.float64 and other.shape == param.shape
    finally:
        dist.destroy_process_group()
