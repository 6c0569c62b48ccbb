"""A data loader that hangs (issue 48, L20): each rank's stream raises a named
``LoaderTimeout`` (which loader, on which host, for which batch, after how long), the rank's
outcome carries the wait, and the driver's diagnosis makes it a ``LoaderStalled`` failure
(the controller's bound on it: tests/control/test_controller_outcomes.py). Pure, no Ray:
a real reader thread over a source that blocks."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from elastic.control.config import ElasticConfig
from elastic.control.diagnosis import RayletProbe, diagnose
from elastic.errors import LoaderStalled, LoaderTimeout, WorkerError, failure_fields
from elastic.ingest.corpus import BatchLayout, RankStream
from elastic.messages import RunOutcome
from elastic.worker.abort import classify

pytestmark = pytest.mark.timeout(60)

SEQ = 8


def _source(hang_at: int, release: threading.Event, error: Exception | None = None):
    """Batches 0.. until ``hang_at``, where it blocks until ``release`` (or raises ``error``)."""
    b = 0
    while True:
        if b == hang_at:
            if error is not None:
                time.sleep(0.2)
                raise error
            release.wait(30)
        yield b, np.zeros((4, SEQ + 1), dtype=np.int64)
        b += 1


def _stream(source) -> RankStream:
    return RankStream(None, BatchLayout(4, 2, 1), 0, 0, prefetch=1, source=source, loader="host reader")


def test_a_hanging_loader_is_named_with_its_host_and_the_time_waited():
    release = threading.Event()
    stream = _stream(_source(1, release))
    try:
        assert stream.next(timeout=0.3)[0] == 0
        started = time.monotonic()
        with pytest.raises(LoaderTimeout) as info:
            stream.next(timeout=0.3)
        assert time.monotonic() - started < 2
    finally:
        release.set()
        stream.close()
    e = info.value
    assert (e.loader, e.host, e.dp_rank, e.batch, e.waited_s) == ("host reader", socket.gethostname(), 0, 1, 0.3)
    assert str(e) == f"the host reader loader on {socket.gethostname()} gave dp rank 0 no batch 1 within 0.3s"


def test_a_read_that_timed_out_itself_is_named_the_same_way():
    """A host feeder's ``ray.get`` of its rows has its own timeout: its ``GetTimeoutError``
    (a ``TimeoutError``) reaches the rank as a named loader timeout, with the read's time."""
    stream = _stream(_source(0, threading.Event(), error=TimeoutError("Get timed out: some object(s) not ready.")))
    try:
        with pytest.raises(LoaderTimeout) as info:
            stream.next(timeout=5)
    finally:
        stream.close()
    assert info.value.batch == 0 and 0.2 <= info.value.waited_s < 5
    assert str(info.value).endswith("(TimeoutError: Get timed out: some object(s) not ready.)")


@dataclass
class _Member:
    rank: int
    node_id: str
    run_result: RunOutcome | None
    last_ok: float = 100.0
    returned_at: float = 99.0
    dead: bool = False


def test_a_rank_whose_loader_hung_is_a_loader_stall_with_its_wait():
    stalled = LoaderTimeout("native", "host-a", 0, 7, 60.0)
    outcome = classify(stalled, 7, blocked_s=0.0, collective_timeout_s=30.0)
    assert (outcome.kind, outcome.loader_wait_s, outcome.retryable) == ("worker_error", 60.0, True)
    assert outcome.detail == f"LoaderTimeout: {stalled}"
    plain = classify(ValueError("bad"), 7, blocked_s=0.0, collective_timeout_s=30.0)
    members = [_Member(0, "n0", outcome), _Member(1, "n1", outcome)]
    f = diagnose(members, ElasticConfig(), 100.0, RayletProbe())
    assert type(f) is LoaderStalled and f.ranks == [0, 1] and f.waited_s == 60.0
    fields = {"cause": "worker_error", "ranks": [0, 1], "nodes": ["n0", "n1"], "detail": outcome.detail}
    assert failure_fields(f) == {**fields, "loader_wait_s": 60.0}
    # another error of the rank's own beside it: an ordinary worker error
    f = diagnose([_Member(0, "n0", outcome), _Member(1, "n1", plain)], ElasticConfig(), 100.0, RayletProbe())
    assert type(f) is WorkerError
