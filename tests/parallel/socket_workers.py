"""Per-rank bodies for the tests of a group's sockets (``tests/parallel/test_sockets.py``):
leaving, cutting the links to a lost rank, and a stuck survivor cutting its own (module
level so spawn can import them)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from parallel_harness import init_group


def blocked_peer_after_leave(rank: int, world: int, out_dir: str, cut: bool, timeout_s: float) -> dict:
    """Rank 2 blocks in an all-reduce on sub-group {1, 2}; rank 1 never joins it and leaves.

    Rank 1 keeps a Python reference to the sub-group (as C++ state can keep a real one alive
    after a failure), so only cutting its sockets can free rank 2 before the timeout. The
    ranks synchronise through a second FileStore, with timeouts, never by sleeping: rank 2
    announces that it enters the all-reduce, rank 1 then leaves (cutting or not) and keeps
    ``sub`` referenced until rank 2 reports that the all-reduce ended.
    """
    import datetime

    from elastic.parallel.sockets import GroupSockets

    sockets = GroupSockets()
    sockets.before_init()
    init_group(rank, world, os.path.join(out_dir, "store"))
    sub = dist.new_group([1, 2], timeout=datetime.timedelta(seconds=timeout_s))
    signals = dist.FileStore(os.path.join(out_dir, "signals"), world)
    signals.set_timeout(datetime.timedelta(seconds=timeout_s * 4))
    dist.barrier()
    sockets.capture()
    result: dict = {"captured": len(sockets.sockets)}
    if rank == 2:
        signals.set("entering", "1")
        t0 = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(4), group=sub)
            result["error"] = None
        except Exception as exc:
            result["error"] = str(exc)[:200]
        result["blocked_s"] = time.perf_counter() - t0
        signals.set("ended", "1")
    elif rank == 1:
        signals.wait(["entering"])
        result["cut"] = sockets.cut() if cut else 0
        signals.wait(["ended"])  # the reference to ``sub`` stays alive meanwhile
    del sub
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return result


def cut_links_to_a_silent_peer(rank: int, world: int, out_dir: str, timeout_s: float, cut: bool) -> dict:
    """Rank 1 is lost but its process lingers, its sockets open (a killed process whose
    memory the kernel is still freeing, or a node without power): it publishes its group
    connections, then stays silent. Rank 2 blocks in an all-reduce with it; with ``cut``,
    another thread of rank 2 (the worker's control thread, given the driver's abort) shuts
    down its links to rank 1 only. Then ranks 0 and 2 all-reduce over their own group: its
    links were left up.
    """
    import datetime
    import json
    import threading

    from elastic.messages import links_to
    from elastic.parallel.sockets import GroupSockets

    sockets = GroupSockets()
    sockets.before_init()
    init_group(rank, world, os.path.join(out_dir, "store"))
    to_lost = dist.new_group([1, 2], timeout=datetime.timedelta(seconds=timeout_s))
    live = dist.new_group([0, 2], timeout=datetime.timedelta(seconds=timeout_s * 4))  # outwaits rank 2's block
    dist.all_reduce(torch.ones(1), group=to_lost) if rank in (1, 2) else None  # connect both groups' pairs
    dist.all_reduce(torch.ones(1), group=live) if rank in (0, 2) else None
    signals = dist.FileStore(os.path.join(out_dir, "signals"), world)
    signals.set_timeout(datetime.timedelta(seconds=timeout_s * 4))
    sockets.capture()
    result: dict = {"connections": len(sockets.connections)}
    if rank == 1:
        signals.set("lost", json.dumps(sockets.connections))
        signals.wait(["done"])  # silent, sockets open, until rank 2 is through and has left
    elif rank == 2:
        lost = [tuple(c) for c in json.loads(signals.get("lost").decode())]

        def abort() -> None:  # the driver's abort_step, on another thread
            signals.wait(["entering"])  # (before or inside it, the all-reduce must fail now)
            result["cut"] = sockets.cut(links_to(lost)) if cut else 0

        control = threading.Thread(target=abort)
        control.start()
        signals.set("entering", "1")
        result.update(_blocked_all_reduce(to_lost))
        control.join()
        x = torch.full((2,), 2.0)
        dist.all_reduce(x, group=live)
        result["live_sum"] = x.tolist()
    else:
        x = torch.full((2,), 1.0)
        dist.all_reduce(x, group=live)
        result["live_sum"] = x.tolist()
    # Rank 2 leaves its groups before rank 1 may exit: without the cut, its pair with rank 1
    # timed out, and gloo's loop thread ends the process (std::terminate, SIGABRT) if that
    # broken pair then sees the peer close (seen once in a clean-clone suite run).
    del to_lost, live
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    if rank == 2:
        signals.set("done", "1")
    return result


def stuck_survivor_cuts_its_own_links(
    rank: int, world: int, out_dir: str, timeout_s: float, cut_reaches: bool = True
) -> dict:
    """Rank 0 is a survivor blocked in an all-reduce with rank 1, whose process holds its
    sockets open and never joins (the stall that neither the abort nor the cut of the links
    to the lost rank freed). The driver's abort starts ``report_if_stuck`` on rank 0, as
    ``TrainWorker.abort_step`` does: after ``after_s`` still in its step, it logs its stacks
    and cuts all of rank 0's own captured connections, which fails the all-reduce.

    ``cut_reaches=False``: that cut shuts nothing (as in an HSDP recovery of 2026-11-29), so
    rank 0 is still in the all-reduce ``leave_after_s`` later and calls ``leave`` (a worker
    exits there; here ``leave`` records the call, then frees the thread by cutting)."""
    import datetime
    import threading

    from elastic.parallel.sockets import GroupSockets
    from elastic.worker.abort import report_if_stuck

    sockets = GroupSockets()
    sockets.before_init()
    init_group(rank, world, os.path.join(out_dir, "store"))
    pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s))
    dist.all_reduce(torch.ones(1), group=pair)  # connected, then captured
    signals = dist.FileStore(os.path.join(out_dir, "signals"), world)
    signals.set_timeout(datetime.timedelta(seconds=timeout_s * 4))
    sockets.capture()
    result: dict = {"connections": len(sockets.connections)}
    if rank == 1:
        signals.wait(["done"])  # silent, sockets open, until rank 0 is through
    else:
        idle = threading.Event()  # set when the "run" ends
        left: list[float] = []

        def leave() -> None:
            left.append(time.perf_counter())
            sockets.cut(sockets.connections)

        with open(os.path.join(out_dir, "stacks"), "w") as stacks:
            cut = (lambda: sockets.cut(sockets.connections)) if cut_reaches else (lambda: 0)
            watch = report_if_stuck(idle, after_s=0.3, file=stacks, then=cut, leave=leave, leave_after_s=0.3)
            result.update(_blocked_all_reduce(pair))
            result["left"] = len(left)
            idle.set()
            assert watch is not None
            watch.join(timeout_s)
        result["stacks_name_the_collective"] = "stuck_survivor_cuts_its_own_links" in open(stacks.name).read()
        signals.set("done", "1")
    del pair
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return result


def _blocked_all_reduce(group) -> dict:
    """An all-reduce a peer never joins: how it ended (``error``) and how long it blocked."""
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        error = None
    except Exception as exc:
        error = str(exc)[:200]
    return {"error": error, "blocked_s": time.perf_counter() - t0}
