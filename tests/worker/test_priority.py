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


def _child(code: str) -> dict:
    """What ``code``, run in a fresh interpreter, printed as JSON (lowering niceness needs
    CAP_SYS_NICE: skipped without root)."""
    if os.geteuid() != 0:
        pytest.skip("lowering niceness needs CAP_SYS_NICE")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_every_thread_back_to_niceness_zero():
    got = _child(CHILD)
    assert got["before"] == 7
    assert got["after"] == [0] and got["threads"] >= 2, got  # the idle thread too
    assert got["late"] == [0], got


RANK = textwrap.dedent(
    """
    import json, os, threading
    from elastic.priority import CONTROL_NICE, control_priority, control_process, training_thread
    def nice(tid=0):
        return os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, 0, 15)  # Ray's worker_niceness
    seen = {}
    def train():  # a rank's training thread, started by Ray before the actor's __init__
        go.wait()
        seen["train_before"] = nice()
        training_thread()
        seen["train"] = nice()
        child = threading.Thread(target=lambda: seen.__setitem__("started_by_train", nice()))
        child.start()
        child.join()
    go = threading.Event()
    t = threading.Thread(target=train)
    t.start()
    seen["process"] = control_priority()
    go.set()
    t.join()
    seen["control"] = nice()
    os.setpriority(os.PRIO_PROCESS, 0, 3)  # a driver's thread at 3: raised during fit(), back after
    with control_process():
        seen["in_fit"] = nice()
        late = threading.Thread(target=lambda: seen.__setitem__("started_in_fit", nice()))
        late.start()
        late.join()
    seen["after_fit"] = nice()
    seen["CONTROL_NICE"] = CONTROL_NICE
    print(json.dumps(seen))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_control_threads_above_the_training_thread_and_fit_restores_the_driver():
    got = _child(RANK)
    c = got["CONTROL_NICE"]
    assert c < 0
    # Every thread of the rank at the control niceness, then the training thread (and what it
    # starts) back at 0.
    assert got["process"] == got["control"] == got["train_before"] == c, got
    assert got["train"] == got["started_by_train"] == 0, got
    # The driver's thread during fit(), the threads fit() started, and the thread afterwards.
    assert got["in_fit"] == got["started_in_fit"] == c and got["after_fit"] == 3, got


@pytest.mark.cluster
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_a_ray_worker_imports_the_rank_at_niceness_zero(ray_local):
    """In a fresh Ray worker process (at Ray's worker_niceness, 15), importing the rank's
    module (as Ray does when it loads ``TrainWorker``) leaves that niceness before torch is
    imported: a new rank's seconds of imports do not wait behind the training ranks."""
    if os.geteuid() != 0:
        pytest.skip("lowering niceness needs CAP_SYS_NICE")

    def probe() -> dict:  # defined here: Ray pickles it by value, not by this test module's name
        import importlib.abc
        import os
        import sys

        seen = {"start": os.getpriority(os.PRIO_PROCESS, 0), "torch_loaded": "torch" in sys.modules}

        class Spy(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    seen.setdefault("at_torch", os.getpriority(os.PRIO_PROCESS, 0))
                return None

        sys.meta_path.insert(0, Spy())
        import elastic.worker.actor  # noqa: F401

        return seen

    got = ray_local.get(ray_local.remote(max_calls=1, num_cpus=0)(probe).remote(), timeout=120)
    assert got == {"start": 15, "torch_loaded": False, "at_torch": 0}, got


@pytest.mark.cluster
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_a_new_rank_opens_its_arguments_at_niceness_zero(ray_local, tiny_spec_dict, tmp_path):
    """Ray deserializes an actor's arguments before it loads the actor's class: a spec passed
    as it is was unpickled, importing torch with it, at Ray's worker niceness (15). Beside a
    nice-0 busy process per core, no rank of a 4-rank start answered in 120 s (with Linux's
    autogroups off). The arguments now travel pickled (``start_args``) and are opened in
    ``__init__``: an argument records the niceness its unpickling ran at."""
    if os.geteuid() != 0:
        pytest.skip("lowering niceness needs CAP_SYS_NICE")
    from elastic.worker import TrainWorker, start_args
    from jobs import JobSpec

    seen = str(tmp_path / "seen.json")

    def record(path: str) -> None:  # defined here: pickled by value, run where it is unpickled
        import json
        import os

        with open(path, "w") as f:
            json.dump({"nice": os.getpriority(os.PRIO_PROCESS, 0)}, f)

    class Recorder:
        def __reduce__(self):
            return record, (seen,)  # unpickles to None: the rank gets no step hook

    fresh = {"env_vars": {"ELASTIC_TEST_FRESH_RANK": os.path.basename(str(tmp_path))}}  # not a pooled process
    spec = JobSpec.from_dict(tiny_spec_dict)
    rank = TrainWorker.options(num_cpus=0, runtime_env=fresh).remote(start_args(spec, "memory://none", Recorder()))
    try:
        assert ray_local.get(rank.info.remote(), timeout=120).pid > 0
    finally:
        ray_local.kill(rank)
    with open(seen) as f:
        assert json.load(f) == {"nice": 0}
