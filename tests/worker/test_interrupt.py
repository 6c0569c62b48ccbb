"""A rank blocked in a collective with a peer that is gone but whose connections stay open
(a machine that lost its power; a killed process until the kernel has freed its memory)
leaves it at once when the driver abandons the step: ``abort_step`` shuts the rank's own
connections of the group down (``ReconfigurableProcessGroup.interrupt``). Without it the
collective waits out its timeout (checked by hand with the interrupt left out: 30 s).

Real parts: the driver's ``RendezvousStore``, two spawned ranks joined through
``ReconfigurableProcessGroup`` with gloo, a real all-reduce that one rank never joins.
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic.testing.ranks import run_ranks
from elastic.worker.process_group import ReconfigurableProcessGroup, RendezvousStore

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

COLLECTIVE_TIMEOUT_S = 30.0


def _blocked_then_interrupted(rank: int, world: int, out_dir: str, address: tuple[str, int], secret: str) -> dict:
    group = ReconfigurableProcessGroup("cpu", COLLECTIVE_TIMEOUT_S)
    group.configure(1, rank, world, address, secret)
    dist.all_reduce(torch.ones(1))  # the pair connects (gloo connects the world group lazily)
    group.built()
    group.settled()
    signals = dist.FileStore(os.path.join(out_dir, "signals"), world)
    signals.set_timeout(datetime.timedelta(seconds=60))
    result: dict = {}
    if rank == 1:
        result["stale"] = group.interrupt(2)  # a notice for another generation cuts nothing
        entering = threading.Event()

        def interrupt() -> None:
            entering.wait(30)
            result["cut"] = group.interrupt(1)

        thread = threading.Thread(target=interrupt)
        thread.start()
        t0 = time.perf_counter()
        entering.set()
        try:
            dist.all_reduce(torch.ones(4))  # rank 0 never joins it, and never closes its end
            result["error"] = None
        except Exception as exc:
            result["error"] = str(exc)[:200]
        result["blocked_s"] = time.perf_counter() - t0
        thread.join(30)
        signals.set("ended", "1")
    else:
        signals.wait(["ended"])  # alive, its connections open, until rank 1 is done
    group.leave()
    return result


def test_abandoning_the_step_frees_a_rank_blocked_on_a_silent_peer(tmp_path):
    server = RendezvousStore("127.0.0.1", 30)
    try:
        results = run_ranks(2, _blocked_then_interrupted, (server.address, server.secret), tmp_path)
    finally:
        server.close()
    blocked = results[1]
    assert blocked["stale"] == 0
    assert blocked["cut"] >= 1 and blocked["error"], blocked
    assert blocked["blocked_s"] < COLLECTIVE_TIMEOUT_S / 6, blocked  # at once; loose for a loaded machine
