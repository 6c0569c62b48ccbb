"""CPU priority of the job's own processes: a rank and a node's control actors (agent,
aggregator) run at normal priority, not at Ray's worker niceness.

Ray starts every worker process at ``worker_niceness`` (15 by default), which is meant for
side work. A rank is the job's main work: at nice 15, any nice-0 process on the host (Ray's
own daemons, the driver, another user's job, a plain ``torchrun`` beside it) takes the CPU
first. On a host with as many busy ranks as cores this costs every step (each wake-up of a
daemon preempts a rank, and its peers wait for it in the next collective), and under a
neighbour's load a nice-15 rank gets a small fraction of a core: a quarter on a loaded
2-core machine, where a nice-0 ``torchrun`` rank kept 95% (``benchmarks/overhead.py``).

Linux keeps the niceness per thread: every thread of this process is set back to 0, and
threads started later inherit it from the thread that starts them. Lowering niceness takes
``CAP_SYS_NICE`` (or an ``RLIMIT_NICE`` allowance): without it the rank stays where Ray put
it, which is logged once (``RAY_worker_niceness=0`` in the environment of ``ray start`` sets
it for the whole cluster instead).

The control plane goes a step further where the host allows it (``CAP_SYS_NICE``): the
node agents, the aggregators, a rank's threads other than its training thread (Ray's RPC
threads, the control calls ``abort_step`` and ``snapshot_holdings``) and the driver's thread
during ``fit()`` run at ``CONTROL_NICE`` (-5), the training thread and what it starts
(gloo's threads, the snapshot copies, torch's intra-op pool) at 0, and a snapshot copy
still running when a peer is lost at ``BACKGROUND_NICE`` (10; ``MemoryTier.yield_copy``).
Raising niceness needs no capability. On a host whose cores
the training keeps busy (CPU training, or data work beside the GPUs), a lost peer's news,
the abort and the survivors' answers then do not queue behind the compute: on this 2-core
machine the news of a node loss under a 0.5 GB model took twice as long from the kill as
under a 50 MB one at equal priority (``benchmarks/recovery_scaling.py``). The control plane
uses ~2% of a core, so the training loses nothing measurable. Without the capability every
thread stays at 0, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

CONTROL_NICE = -5  # the control plane's threads, where the host allows it (module docstring)
TRAIN_NICE = 0
BACKGROUND_NICE = 10  # work that must not delay a recovery: a snapshot copy after a peer was lost


def normal_priority() -> int:
    """Set every thread of this process to niceness 0 where it is above; returns the
    niceness the process had (that of the calling thread)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if _threads_to_normal():
        logger.warning(
            "this rank runs at niceness %d (Ray's worker_niceness) and may not lower it (no CAP_SYS_NICE): "
            "any normal-priority process on the host takes the CPU first; start Ray with "
            "RAY_worker_niceness=0 to train at normal priority",
            before,
        )
    return before


def _threads_to_normal() -> int:
    """Every thread of this process above niceness 0 set to 0; returns how many may not be."""
    denied = 0
    for tid in _threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > TRAIN_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, TRAIN_NICE)
        except PermissionError:
            denied += 1
        except (ProcessLookupError, OSError):  # the thread ended meanwhile
            continue
    return denied


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's niceness is the only one
        return [0]


def _set(tid: int, nice: int) -> bool:
    """Thread ``tid`` at ``nice``; False where that is not allowed (a thread that ended counts as done)."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except PermissionError:
        return False
    except (ProcessLookupError, OSError):
        return True


def leave_ray_worker_niceness() -> None:
    """In a Ray worker process (``RAY_RAYLET_PID`` in its environment): every thread above
    niceness 0 set to 0, quietly. Run by ``elastic.worker`` before the rank's imports.

    Ray starts the process at its ``worker_niceness`` (15), and the rank's module is
    imported by ``TrainWorker.__init__`` before ``Rank.__init__`` can call
    ``control_priority``: its imports (torch, DCP, DTensor, the engine, pipelining: about
    3.5 s of one core) ran at nice 15, behind every nice-0 rank on the host, while a
    recovery or a grow-back waited for the new rank. At 0, the imports share the host's
    cores evenly with the training ranks, and no more than that. Where lowering is not
    allowed, nothing changes; ``Rank.__init__`` logs it (``normal_priority``)."""
    if "RAY_RAYLET_PID" in os.environ:  # not a driver, a test, ``make gpu-check``: left as started
        _threads_to_normal()


def control_priority() -> int:
    """Every thread of this process at ``CONTROL_NICE`` where the host allows it, else at 0
    where above (``normal_priority``); returns the niceness the process ends at (the calling
    thread's). For a node agent, an aggregator, and a rank before its training thread starts."""
    if not all(_set(tid, CONTROL_NICE) for tid in _threads()):
        normal_priority()
    return os.getpriority(os.PRIO_PROCESS, 0)


def training_thread() -> None:
    """The calling thread (a rank's training thread) at ``TRAIN_NICE``, and with it every
    thread it starts from now on. Raising niceness is always allowed."""
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < TRAIN_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, TRAIN_NICE)
    except OSError:
        pass


def background_thread(tid: int) -> None:
    """Thread ``tid`` of this process at ``BACKGROUND_NICE`` (raising niceness is always
    allowed; a thread that ended is left alone)."""
    with contextlib.suppress(OSError):
        if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
            _set(tid, BACKGROUND_NICE)


@contextlib.contextmanager
def control_process() -> Iterator[None]:
    """Every thread of this process at ``CONTROL_NICE`` while the block runs (the driver's
    ``fit()``: its control loop, Ray's driver threads), each back at its niceness of before
    afterwards (threads started meanwhile: at the calling thread's). Nothing changes where
    the host does not allow it."""
    before = {}
    for tid in _threads():
        with contextlib.suppress(OSError):
            before[tid] = os.getpriority(os.PRIO_PROCESS, tid)
    mine = before.get(threading.get_native_id(), TRAIN_NICE)
    raised = [tid for tid, nice in before.items() if nice > CONTROL_NICE and _set(tid, CONTROL_NICE)]
    try:
        yield
    finally:
        if raised:
            for tid in _threads():
                with contextlib.suppress(OSError):
                    if os.getpriority(os.PRIO_PROCESS, tid) == CONTROL_NICE:
                        _set(tid, before.get(tid, mine))
