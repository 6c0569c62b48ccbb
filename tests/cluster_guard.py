"""The ``cluster`` marker, enforced: an unmarked test may not start a cluster in-process.

`make test-fast` is ``-m "not cluster and not slow and not gpu"``, so a test that starts Ray,
a process group or worker processes must say so with ``@pytest.mark.cluster`` (or in its
module's ``pytestmark``). So that a missing marker cannot hide, ``tests/conftest.py`` runs
every unmarked test (from its fixtures' setup to their teardown) with the entry points below
replaced by a guard that fails it, naming the call. In-process calls only: a test that runs
the CLI in a subprocess which starts Ray is marked by review.
"""

from __future__ import annotations

import pytest

_FAILURES = pytest.StashKey[list]()


def entry_points() -> list[tuple[object, str, str]]:
    """(owner, attribute, what) of every in-process way to start a cluster; a library that
    is not installed (the GPU check runs without Ray) starts nothing and is left out."""
    import multiprocessing.process

    found: list[tuple[object, str, str]] = [
        (multiprocessing.process.BaseProcess, "start", "a worker process (multiprocessing)")
    ]
    try:
        import ray
        import ray._private.worker
        from ray.cluster_utils import Cluster
    except ImportError:
        pass
    else:
        found += [
            (ray, "init", "ray.init"),  # also what Ray's auto-init (a bare ray.remote/.get) calls
            (ray._private.worker, "init", "ray.init"),
            (Cluster, "__init__", "ray.cluster_utils.Cluster()"),
        ]
    try:
        import torch.distributed
        import torch.distributed.distributed_c10d
    except ImportError:
        pass
    else:
        found += [
            (torch.distributed, "init_process_group", "torch.distributed.init_process_group"),
            (torch.distributed.distributed_c10d, "init_process_group", "torch.distributed.init_process_group"),
        ]
    return found


def install(item: pytest.Item, patch: pytest.MonkeyPatch) -> None:
    """Replace every entry point by a guard that fails ``item``, until ``patch`` is undone."""
    for owner, name, what in entry_points():
        patch.setattr(owner, name, _guard(item, what))


def failures(item: pytest.Item) -> list[str]:
    """What the guards refused during ``item``, even if the test caught the failure."""
    return item.stash.get(_FAILURES, [])


def _guard(item: pytest.Item, what: str):
    def refuse(*args, **kwargs):
        message = (
            f"{item.nodeid} calls {what} but is not marked `cluster`: add @pytest.mark.cluster "
            "(or put it in the module's pytestmark) so that `make test-fast` leaves it out"
        )
        item.stash.setdefault(_FAILURES, []).append(message)
        pytest.fail(message, pytrace=False)

    refuse.cluster_guard = what
    return refuse
