"""The rank's Ray actor (``elastic/worker/remote.py``): a process handed a rank's handle does
not import the training stack. Ray loads an actor's class wherever its handle is
deserialized; a node agent gets its ranks' handles with ``Attach``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.worker import TrainWorker, start_args
from jobs import JobSpec

pytestmark = pytest.mark.timeout(120)


@pytest.mark.cluster
def test_a_process_handed_a_rank_handle_imports_no_torch(ray_local, tiny_spec_dict):
    """Before the shell, the holder imported torch on taking the handle (1.8 s and 240 MB
    more in every node agent, before its first command could be applied: job_start.py)."""
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Holder:  # defined here: Ray pickles it by value and imports nothing for it
        def loaded(self) -> list[str]:
            import sys

            return sorted(m for m in ("torch", "elastic.worker.actor") if m in sys.modules)

        def take(self, handles: list) -> list[str]:
            assert all(hasattr(h, "reconfigure") for h in handles)  # a real handle, its methods known
            return self.loaded()

    # A fresh process (its own runtime env): no pooled worker that imported torch for another test.
    holder = Holder.options(runtime_env={"env_vars": {"ELASTIC_TEST_FRESH_HOLDER": "1"}}).remote()
    rank = TrainWorker.options(num_cpus=0).remote(start_args(JobSpec.from_dict(tiny_spec_dict), "memory://none"))
    try:
        assert ray.get(holder.loaded.remote(), timeout=60) == []
        assert ray.get(holder.take.remote([rank]), timeout=60) == []
        assert ray.get(rank.info.remote(), timeout=60).pid > 0  # the rank itself started, behind the shell
    finally:
        ray.kill(rank)
        ray.kill(holder)


def test_a_ranks_first_build_imports_nothing_its_module_did_not(tmp_path):
    """What the first engine build needs (DDP imports torch._dynamo: about 1 s of one core)
    is imported with the rank's module, while the rank starts: a rank spawned ahead for a
    grow-back must not pay it in the pause. (Making pipelining lazy moved it there: the
    ~100M grow-back's rebuild went from 0.02-0.05 s to 0.44-0.51 s.)"""
    probe = (
        "import sys, torch; import elastic.worker.actor; import torch.distributed as dist; "
        "dist.init_process_group('gloo', init_method='file://' + sys.argv[1], rank=0, world_size=1); "
        "before = set(sys.modules); torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4)); "
        "print(sorted(m for m in set(sys.modules) - before if m.startswith(('torch._dynamo', 'torch.fx'))))"
    )
    store = str(tmp_path / "store")  # a file store: no port to collide with another test's
    out = subprocess.run([sys.executable, "-c", probe, store], capture_output=True, text=True, timeout=90, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:] + out.stderr[-2000:]
