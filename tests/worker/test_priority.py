"""``elastic/priority.py``: a rank set back to niceness 0 on every thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = textwrap.dedent(
    """
    import json, os, threading
    from elastic.priority import normal_priority
    os.setpriority(os.PRIO_PROCESS, 0, 7)  # as Ray's worker_niceness would, before the threads start
    started, done = threading.Event(), threading.Event()
    def idle():
        started.set()
        done.wait()
    t = threading.Thread(target=idle)
    t.start()
    started.wait()
    before = normal_priority()
    after = {int(tid): os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}
    late = []  # a thread started afterwards inherits its starter's niceness
    t2 = threading.Thread(target=lambda: late.append(os.getpriority(os.PRIO_PROCESS, 0)))
    t2.start()
    t2.join()
    done.set()
    t.join()
    print(json.dumps({"before": before, "after": sorted(set(after.values())), "threads": len(after), "late": late}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_every_thread_back_to_niceness_zero():
    if os.geteuid() != 0:
        pytest.skip("lowering niceness needs CAP_SYS_NICE")
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=50, check=True)
    got = json.loads(out.stdout)
    assert got["before"] == 7
    assert got["after"] == [0] and got["threads"] >= 2, got  # the idle thread too
    assert got["late"] == [0], got
