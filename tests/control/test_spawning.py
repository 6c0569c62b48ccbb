"""A start the controller does not wait for (``elastic/control/spawning.py``), on real Ray
actors: its answers are looked at without blocking, a slow start that makes progress is
waited for, a lost or stalled start kills them all."""

from __future__ import annotations

import time

import pytest
import ray

from elastic.control.spawning import PendingSpawn
from elastic.errors import ActorDied

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]


@ray.remote(num_cpus=0)
class _Starting:
    """Answers ``info()`` once its start is let go (as a worker once its imports are done)."""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def ping(self) -> bool:
        return True

    def info(self) -> str:
        import os

        deadline = time.monotonic() + 60
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.path.exists(self.gate + ".die"):
            os._exit(1)
        return f"info {os.getpid()}"


def _pending(gate: str, n: int, within_s: float) -> PendingSpawn:
    actors = [(f"pg{i}", 0, _Starting.remote(gate)) for i in range(n)]
    return PendingSpawn(actors, [a.info.remote() for _, _, a in actors], stall_s=within_s)


def _gone(actor) -> bool:
    try:
        ray.get(actor.info.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_a_start_is_looked_at_without_waiting_then_collected(ray_local, tmp_path):
    gate = str(tmp_path / "go")
    pending = _pending(gate, 2, within_s=120)
    t0 = time.monotonic()
    assert pending.infos(0.0) is None  # starting: answered at once, not waited for
    assert pending.infos(0.2) is None
    assert time.monotonic() - t0 < 5
    open(gate, "w").close()
    infos = None
    deadline = time.monotonic() + 110  # their processes may still be starting (a minute on a loaded host)
    while infos is None and time.monotonic() < deadline:
        infos = pending.infos(0.5)
    assert infos is not None and len(infos) == 2 and all(i.startswith("info ") for i in infos)
    assert _pending(gate, 0, within_s=1).infos(0.0) == []


def test_a_start_past_its_deadline_or_lost_kills_every_new_actor(ray_local, tmp_path):
    gate = str(tmp_path / "go")
    late = _pending(gate, 2, within_s=0.5)
    assert late.infos(0.0) is None
    # The stall says what Ray knows of the workers (here: starting, or answering a gated info()).
    stalled = r"lost while starting: GetTimeoutError: 2 of 2 new worker\(s\) did not start: .* \(Ray: \d [A-Z_]+"
    with pytest.raises(ActorDied, match=stalled):
        late.infos(5.0)  # waits out the deadline only
    assert all(_gone(a) for _, _, a in late.actors)

    open(gate + ".die", "w").close()
    open(gate, "w").close()
    lost = _pending(gate, 2, within_s=120)
    with pytest.raises(ActorDied, match="lost while starting"):
        deadline = time.monotonic() + 110
        while time.monotonic() < deadline:
            lost.infos(0.5)
    assert all(_gone(a) for _, _, a in lost.actors)


def test_a_slow_start_that_makes_progress_is_not_late(ray_local, tmp_path):
    """Three workers answer one after another, the whole start taking longer than the
    stall bound but never going that long without an answer (Ray starts a node's worker
    processes a few at a time): it is waited for, not killed and begun again."""
    stall_s, gap_s = 6.0, 3.5
    gates = [str(tmp_path / f"go{i}") for i in range(3)]
    actors = [(f"pg{i}", 0, _Starting.remote(gate)) for i, gate in enumerate(gates)]
    # Their processes up first (seconds on a loaded host): the start's pace is the gates'.
    ray.get([a.ping.remote() for _, _, a in actors], timeout=120)
    pending = PendingSpawn(actors, [a.info.remote() for _, _, a in actors], stall_s=stall_s)
    t0 = time.monotonic()
    infos = None
    for gate in gates:
        open(gate, "w").close()
        opened = time.monotonic()
        while infos is None and time.monotonic() - opened < gap_s:
            infos = pending.infos(0.2)
    while infos is None and time.monotonic() - t0 < 60:
        infos = pending.infos(0.2)
    assert infos is not None and len(infos) == 3
    assert time.monotonic() - t0 > stall_s  # longer than a fixed deadline of stall_s would allow


def test_cancel_kills_a_start_in_flight(ray_local, tmp_path):
    pending = _pending(str(tmp_path / "never"), 2, within_s=60)
    assert pending.infos(0.0) is None
    pending.cancel()
    assert all(_gone(a) for _, _, a in pending.actors)
