"""The rank runtime (``elastic/worker/runtime.py``) under both payloads: two real gloo
ranks join through it and a collective one of them is blocked in fails as soon as the
runtime cuts its links; its liveness brackets a run; and both rank actors (the built-in
trainer's ``Rank``, a user's loop's ``LoopRank``) own one and join no group of their own."""

from __future__ import annotations

import ast
import pathlib
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic.testing.ranks import run_ranks
from elastic.worker.process_group import RendezvousStore
from elastic.worker.runtime import RankRuntime, rss_bytes

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEER_LEAVES_AFTER_S = 4.0


def _blocked(rank: int, world: int, out_dir: str, address: tuple[str, int], secret: str) -> dict:
    runtime = RankRuntime("cpu", 30, connect_world_at_once=True)
    runtime.join(1, rank, world, address, secret)
    runtime.settled()
    dist.barrier()  # every pair connected, as a loop's join does
    runtime.built()
    out: dict = {"connected": runtime.connected(), "generation": runtime.generation}
    if rank == 0:  # blocked in an all-reduce its peer never enters; the runtime cuts it free
        timer = threading.Timer(0.5, runtime.cut)
        timer.start()
        t0 = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1))
            out["error"] = None
        except Exception as exc:  # noqa: BLE001 - the cut collective's error is the point
            out["error"] = type(exc).__name__
        out["blocked_s"] = time.perf_counter() - t0
        timer.join()
    else:
        time.sleep(PEER_LEAVES_AFTER_S)  # its leave would free rank 0 too, but only now
    runtime.leave()
    return out


@pytest.mark.cluster
def test_a_collective_blocked_on_a_silent_peer_fails_when_the_runtime_cuts_its_links(tmp_path):
    server = RendezvousStore("127.0.0.1", 30)
    try:
        results = run_ranks(2, _blocked, (server.address, server.secret), tmp_path)
    finally:
        server.close()
    assert all(r["connected"] and r["generation"] == 1 for r in results)
    assert results[0]["error"] is not None
    assert results[0]["blocked_s"] < PEER_LEAVES_AFTER_S / 2, results[0]  # the cut, not the peer's leave


def test_liveness_brackets_a_run_and_the_abort_watch_needs_one():
    runtime = RankRuntime("cpu", 30)
    assert runtime.device() == torch.device("cpu") and runtime.phase == "idle" and runtime.idle.is_set()
    runtime.enter("train")
    beat = runtime.beat
    with runtime.running():
        assert runtime.phase == "train" and not runtime.idle.is_set()
    assert runtime.phase == "idle" and runtime.idle.is_set() and runtime.beat >= beat
    runtime.aborted.set()
    runtime.ready()
    assert runtime.phase == "ready" and not runtime.aborted.is_set()
    runtime.leave_if_stuck()  # no run in progress: nothing to watch, the process stays
    assert not runtime.connected() and runtime.cut(()) == 0
    assert rss_bytes() > 0


def _constructed(path: pathlib.Path) -> set[str]:
    return {
        node.func.id
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def test_both_rank_actors_are_payloads_on_one_runtime():
    """The process group is made in the runtime alone (the test harnesses aside), and both
    rank actors build the runtime."""
    makers = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "elastic").rglob("*.py")
        if "testing" not in p.parts and "ReconfigurableProcessGroup" in _constructed(p)
    )
    assert makers == ["elastic/worker/runtime.py"]
    for actor in ("elastic/worker/actor.py", "elastic/train/rank.py"):
        assert "RankRuntime" in _constructed(ROOT / actor), actor


def test_both_payloads_answer_the_same_rpc_names():
    """The built-in rank (its actor shell and its body) and a loop's rank answer the names of
    ``RankPayload``, and an abort takes the same arguments on both (the generation it is of,
    the links to cut)."""
    import inspect

    from elastic.train.rank import LoopRank
    from elastic.worker.actor import Rank
    from elastic.worker.remote import TrainWorker
    from elastic.worker.runtime import RankPayload

    names = [n for n in vars(RankPayload) if not n.startswith("_") and callable(getattr(RankPayload, n))]
    assert sorted(names) == ["abort_step", "info", "poll", "request_stop", "run", "store_replica"]
    shell = TrainWorker.__ray_actor_class__  # the class behind Ray's handle
    for cls in (Rank, shell, LoopRank):
        missing = [n for n in names if not callable(getattr(cls, n, None))]
        assert not missing, (cls, missing)
        params = list(inspect.signature(cls.abort_step).parameters)
        assert params[1:3] == ["generation", "links"], (cls, params)
