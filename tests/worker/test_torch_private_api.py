"""Every private torch name the elastic runtime relies on still exists.

They are all called from ``elastic/worker/process_group.py`` (and the gloo sub-group
timeout from ``elastic/parallel/dims.py``). A torch upgrade that moves one fails here, by
name, instead of as a hang in the middle of a recovery.
"""

from __future__ import annotations

import importlib

import pytest

from elastic.worker.process_group import PRIVATE_TORCH_API

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
