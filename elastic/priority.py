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

The node agents and aggregators are set back too: they use ~2% of a core, but at nice 15
beside ranks at nice 0 they would wait for a core behind every busy rank, and the news of a
lost peer with them.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def normal_priority() -> int:
    """Set every thread of this process to niceness 0 where it is above; returns the
    niceness the process had (that of the calling thread)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's niceness is the only one
        tids = [0]
    denied = 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except PermissionError:
            denied += 1
        except (ProcessLookupError, OSError):  # the thread ended meanwhile
            continue
    if denied:
        logger.warning(
            "this rank runs at niceness %d (Ray's worker_niceness) and may not lower it (no CAP_SYS_NICE): "
            "any normal-priority process on the host takes the CPU first; start Ray with "
            "RAY_worker_niceness=0 to train at normal priority",
            before,
        )
    return before
