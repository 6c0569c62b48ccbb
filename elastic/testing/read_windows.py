"""The windows in which staggered reads hold their bound at storage (docs/data.md, "Staggered
reads"), for the tests and benchmarks that count GETs through ``elastic.testing.s3proxy``.

- **Start-up**: from before the driver's check of the corpus to the job's start (the first
  configure returns once every host has read its first window, in waves). From there on
  the hosts read side by side as training consumes: the steady state, which the bound does
  not cover (the first step's own prefetch included).
- **Recovery**: from the end of the driver's quiesce of the old layout's readers
  (``HostReaders._quiesce``, in the new layout's ``plans``) to the new layout's first
  windows (the configure's return: the ``restore`` event). Before the quiesce, the readers
  are paused at the failure's detection (``HostReaders.pause``): the GETs they had already
  started, at most ``max_reads_per_host`` per host, end in that gap.

``QuiesceClock`` records the driver's quiesces (start, end) in the driver's process, where a
test or a benchmark runs ``ElasticTrainer``.
"""

from __future__ import annotations

from typing import Any


class QuiesceClock:
    """While entered, every ``HostReaders._quiesce`` in this process is timed: ``spans`` holds
    its (start, end) in unix seconds."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._orig: Any = None

    def __enter__(self) -> QuiesceClock:
        import time

        from elastic.ingest.host_readers import HostReaders

        orig = self._orig = HostReaders._quiesce
        spans = self.spans

        def timed(readers: HostReaders, nodes: list[str]) -> None:
            t = time.time()
            try:
                orig(readers, nodes)
            finally:
                spans.append((t, time.time()))

        HostReaders._quiesce = timed  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        from elastic.ingest.host_readers import HostReaders

        HostReaders._quiesce = self._orig  # type: ignore[method-assign]


def startup_window(events: list[dict[str, Any]], t0: float) -> tuple[float, float]:
    """From ``t0`` (before the driver's corpus check) to the job's start."""
    return t0, next(e["ts"] for e in events if e["kind"] == "job_start" and e["ts"] > t0)


def recovery_window(events: list[dict[str, Any]], quiesces: list[tuple[float, float]]) -> tuple[float, float]:
    """From the end of the first quiesce that began after the first failure's detection to
    the restore that follows it."""
    failure = next(e["ts"] for e in events if e["kind"] == "failure")
    quiet = next(end for start, end in quiesces if start >= failure)
    return quiet, next(e["ts"] for e in events if e["kind"] == "restore" and e["ts"] > quiet)
