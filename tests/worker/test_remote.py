"""The rank's Ray actor (``elastic/worker/remote.py``): a process handed a rank's handle does
not import the training stack. Ray loads an actor's class wherever its handle is
deserialized; a node agent gets its ranks' handles with ``Attach``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.worker import TrainWorker
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
            assert all(hasattr(h, "configure") for h in handles)  # a real handle, its methods known
            return self.loaded()

    # A fresh process (its own runtime env): no pooled worker that imported torch for another test.
    holder = Holder.options(runtime_env={"env_vars": {"ELASTIC_TEST_FRESH_HOLDER": "1"}}).remote()
    rank = TrainWorker.options(num_cpus=0).remote(JobSpec.from_dict(tiny_spec_dict), "memory://none", None)
    try:
        assert ray.get(holder.loaded.remote(), timeout=60) == []
        assert ray.get(holder.take.remote([rank]), timeout=60) == []
        assert ray.get(rank.info.remote(), timeout=60).pid > 0  # the rank itself started, behind the shell
    finally:
        ray.kill(rank)
        ray.kill(holder)


def test_the_rank_imports_pipelining_only_for_pp_jobs():
    """``torch.distributed.pipelining`` (with torch._dynamo: 0.35 s of one core per rank) is
    imported by a rank of a PP job in ``Rank.__init__``, by no other."""
    probe = (
        "import sys; import elastic.worker.actor; "
        "print('torch.distributed.pipelining' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=90, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
