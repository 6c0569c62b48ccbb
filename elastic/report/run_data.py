"""Read a run directory and derive what the report shows (``docs/observability.md``).

Everything here is computed from ``events.jsonl`` alone (``summary.json`` is only quoted
when present), so it works on a finished, failed or still running run: a line that does not
parse (a half-written last line) is skipped, and a missing ``summary.json`` is allowed.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

ANOMALIES = ("nan_loss", "loss_spike")


@dataclass(frozen=True)
class Pause:
    """Time with no step completing around a failure or a resize.

    ``start`` is the last step finished before the event and ``end`` the first one after it
    (unix seconds); ``gap_s = end - start`` therefore includes one ordinary step time.
    ``end`` is None when no step followed (the run stopped or is still recovering).
    """

    start: float
    end: float | None
    label: str
    cause: str  # a failure cause, or "resize" for a resize with no failure before it

    @property
    def gap_s(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclass(frozen=True)
class FailureMark:
    ts: float
    cause: str
    step: float  # where it goes on a step axis: the step it hit (anomaly) or the last one committed + 0.5
    ranks: list[int]
    nodes: list[str]
    gap_s: float | None  # the pause around it, from events.jsonl
    downtime_s: float | None  # summary.json's figure for it, when summary.json can be matched


@dataclass
class RunData:
    run_dir: str
    events: list[dict[str, Any]]
    summary: dict[str, Any] | None
    skipped_lines: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    failures: list[FailureMark] = field(default_factory=list)
    resizes: list[dict[str, Any]] = field(default_factory=list)
    restores: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    pauses: list[Pause] = field(default_factory=list)
    t0: float = 0.0

    @property
    def status(self) -> str:
        for e in reversed(self.events):
            if e["kind"] == "job_end":
                return e.get("status", "?")
        return "running (or stopped without a job_end event)"

    def dp_timeline(self) -> list[tuple[float, int]]:
        """``(ts, dp)`` whenever the DP degree changes: at the start, each resize and each step."""
        points: list[tuple[float, int]] = []
        for e in self.events:
            dp = {"job_start": e.get("dp"), "resize": e.get("new_dp"), "step": e.get("dp")}.get(e["kind"])
            if dp is not None and (not points or points[-1][1] != dp):
                points.append((e["ts"], int(dp)))
        return points


def read_events_tolerant(path: str) -> tuple[list[dict[str, Any]], int]:
    """Parse ``events.jsonl``; returns the events and how many lines did not parse."""
    events, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(obj, dict) and "kind" in obj and isinstance(obj.get("ts"), int | float):
                events.append(obj)
            else:
                bad += 1
    return events, bad


def load_run(run_dir: str) -> RunData:
    """Raises FileNotFoundError when ``run_dir`` has no ``events.jsonl``."""
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    events, bad = read_events_tolerant(path)
    summary = None
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        pass
    data = RunData(run_dir=run_dir, events=events, summary=summary, skipped_lines=bad)
    data.t0 = events[0]["ts"] if events else 0.0
    for e in events:
        kind = e["kind"]
        if kind == "step":
            data.steps.append(e)
        elif kind == "resize":
            data.resizes.append(e)
        elif kind == "restore":
            data.restores.append(e)
        elif kind == "checkpoint":
            data.checkpoints.append(e)
    data.pauses = _pauses(events)
    data.failures = _failures(events, data.pauses, summary)
    return data


def _step_around(events: list[dict[str, Any]], i: int) -> tuple[dict | None, dict | None]:
    """The last step finished at or before event ``i`` and the first one after it, by time: a
    step that survivors finished before a failure may be written after the failure's line."""
    ts = events[i]["ts"]
    steps = [e for e in events if e["kind"] == "step"]
    before = max((e for e in steps if e["ts"] <= ts), key=lambda e: e["ts"], default=None)
    after = min((e for e in steps if e["ts"] > ts), key=lambda e: e["ts"], default=None)
    return before, after


def _pauses(events: list[dict[str, Any]]) -> list[Pause]:
    """One pause per failure (not a NaN or spike: those roll back inside a step) or resize,
    merged when they share the same stretch without steps."""
    pauses: list[Pause] = []
    for i, e in enumerate(events):
        if e["kind"] == "failure" and e.get("cause") not in ANOMALIES:
            cause, label = e.get("cause", "?"), f"{e.get('cause', '?')}"
        elif e["kind"] == "resize":
            cause, label = "resize", f"resize dp {e.get('old_dp')}->{e.get('new_dp')}"
        else:
            continue
        before, after = _step_around(events, i)
        start = before["ts"] if before else events[0]["ts"]
        end = after["ts"] if after else None
        if pauses and pauses[-1].start == start:  # same gap: a failure and its resize
            p = pauses[-1]
            pauses[-1] = Pause(p.start, p.end, p.label if p.cause != "resize" else label, p.cause)
            continue
        pauses.append(Pause(start, end, label, cause))
    return pauses


_STEP_IN_DETAIL = re.compile(r"^step (\d+)\b")


def _failures(events: list[dict[str, Any]], pauses: list[Pause], summary: dict | None) -> list[FailureMark]:
    marks: list[FailureMark] = []
    recoveries = list((summary or {}).get("recoveries") or [])
    for i, e in enumerate(events):
        if e["kind"] != "failure":
            continue
        cause = e.get("cause", "?")
        before, _ = _step_around(events, i)
        m = _STEP_IN_DETAIL.match(str(e.get("detail", "")))
        if cause in ANOMALIES and m:
            x = float(m.group(1))
        else:
            x = (before["step"] if before else 0) + 0.5
        gap = None
        if cause not in ANOMALIES:
            start = before["ts"] if before else events[0]["ts"]
            gap = next((p.gap_s for p in pauses if p.start == start), None)
        marks.append(FailureMark(e["ts"], cause, x, list(e.get("ranks") or []), list(e.get("nodes") or []), gap, None))
    # summary.json lists one recovery per recovered failure, in order; quote its downtime
    # only when the causes line up one to one.
    if recoveries and len(recoveries) <= len(marks):
        if all(r.get("cause") == f.cause for r, f in zip(recoveries, marks, strict=False)):
            marks = [
                FailureMark(f.ts, f.cause, f.step, f.ranks, f.nodes, f.gap_s, r.get("downtime_s"))
                if j < len(recoveries)
                else f
                for j, (f, r) in enumerate(zip(marks, recoveries + [{}] * len(marks), strict=False))
            ]
    return marks


def throughput_by_dp(steps: list[dict[str, Any]]) -> dict[int, float]:
    """The median tokens/s of the steps at each DP degree (the median shrugs off the first
    step after each re-formation, which includes warm-up)."""
    by: dict[int, list[float]] = {}
    for s in steps:
        if s.get("tokens_per_s"):
            by.setdefault(int(s["dp"]), []).append(float(s["tokens_per_s"]))
    return {dp: statistics.median(v) for dp, v in sorted(by.items())}


def scale_factors(steps: list[dict[str, Any]]) -> dict[int, float]:
    """T_n / (n·T) for each DP degree n the run trained at, where T_n is the median tokens/s
    at DP n and T the per-replica throughput at the smallest DP seen (T = T_m / m): 1.0 at
    the smallest DP, 1.0 everywhere for perfect scaling. Empty with fewer than two degrees."""
    t = throughput_by_dp(steps)
    if len(t) < 2:
        return {}
    m = min(t)
    per_replica = t[m] / m
    return {n: tn / (n * per_replica) for n, tn in t.items()}


def skipped_batches(events: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """``(step, batch_index)`` for every batch a NaN or spike made the run skip."""
    out = []
    for e in events:
        if e["kind"] == "failure" and e.get("cause") in ANOMALIES:
            m = re.search(r"^step (\d+).*\bskip\w* batch (\d+)", str(e.get("detail", "")))
            if m:
                out.append((int(m.group(1)), int(m.group(2))))
    return out
