"""Run artefacts: ``events.jsonl`` (one JSON object per line) and ``summary.json``.

Field names are the public contract described in ``docs/outputs.md``. Every event has ``ts`` (unix
seconds) and ``kind``; a few events carry extra fields (``step`` may add
``peak_mem_bytes`` and ``mfu``; ``job_end`` adds ``reason`` when the job failed).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

EVENT_KINDS = (
    "job_start",
    "step",
    "checkpoint",
    "failure",
    "resize",
    "restore",
    "placement",
    "job_end",
    "straggler",
    "sdc",
    "node_excluded",
    "eval",
)


class Recovery(BaseModel):
    """One recovery, timed on the driver's monotonic clock (one clock, whatever the hosts).

    ``failed_at`` is the last time the driver heard from a culprit (its last poll answer;
    the worker died after it, within one 0.1 s poll interval), or the detection time when
    there is no culprit to have heard from. The first step at the new size counts once its
    results from every rank have reached the driver. An anomaly (NaN, spike) is rolled back
    inside the step on the workers: nothing pauses, so its three times are 0 and its cost is
    ``lost_steps``.
    """

    cause: str
    detect_s: float = Field(description="from the failure (failed_at) to its detection")
    recover_s: float = Field(description="from detection to the first completed step at the new size")
    downtime_s: float = Field(
        description="from the failure (failed_at) to the first completed step at the new size: detect_s + recover_s"
    )
    lost_steps: int = Field(
        description="the newest step any worker reported completing minus the step training resumed from"
    )
    breakdown: dict[str, float] = Field(
        default_factory=dict,
        description="where the downtime went, phase by phase (elastic/control/timing.py; docs/outputs.md)",
    )
    failures: int = Field(
        1, description="failures folded into this one outage (a failure during a recovery extends it)"
    )


class RunResult(BaseModel):
    """The outcome of a run; the same fields as ``summary.json``."""

    status: str
    steps: int
    final_loss: float | None
    wall_s: float
    mean_tokens_per_s: float | None = Field(
        description="tokens trained per second over the run; null where not measured (a TorchTrainer run)"
    )
    mean_rows_per_s: float | None = Field(
        None,
        description="a TorchTrainer run: rows its loaders served per second, the mean over steps "
        "(docs/train_api.md); left out of summary.json when not measured",
    )
    failures: int
    dp_history: list[list[int]] = Field(default_factory=list)
    recoveries: list[Recovery] = Field(default_factory=list)
    excluded_nodes: list[dict] = Field(
        default_factory=list, description="lemon nodes not used again: {node_id, reason} (docs/health.md)"
    )
    checkpoint_failures: list[dict[str, Any]] = Field(
        default_factory=list,
        description="storage checkpoints that could not be committed: {step, cause} (docs/outputs.md)",
    )
    stop: dict[str, Any] | None = Field(
        None, description="a stopped job only: signal, checkpoint_step (null: none written), stop_reason"
    )


class EventLog:
    """Append-only, thread-safe writer of ``events.jsonl`` with in-process listeners.

    A write the OS refuses (a full disk, a file-size limit, a removed run directory) never
    raises into the caller: the file is cut back to its last whole line, nothing more is
    written, and :meth:`fault` names the cause, which the controller turns into a failed job
    (listeners still see every event). The file is created 0640, as the run directory's
    other files (docs/outputs.md).
    """

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "events.jsonl")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._closed = weakref.finalize(self, os.close, self._fd)  # closed also when never close()d
        self._size = os.fstat(self._fd).st_size  # the end of the last whole line
        self._fault: str | None = None
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.append(listener)

    def emit(self, kind: str, ts: float | None = None, **fields: Any) -> dict[str, Any]:
        """Write one event; ``ts`` defaults to now (a step passes when it actually finished)."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        event = {"ts": time.time() if ts is None else ts, "kind": kind, **{k: _plain(v) for k, v in fields.items()}}
        line = (json.dumps(event, allow_nan=False) + "\n").encode()
        with self._lock:
            if self._fault is None:
                self._append(line)
        for listener in self._listeners:
            listener(event)
        return event

    def _append(self, line: bytes) -> None:
        done = 0
        try:
            while done < len(line):  # a short write is followed by the error that explains it
                done += os.write(self._fd, line[done:])
        except OSError as exc:
            self._fault = f"{self.path}: {exc.strerror or exc}"
            try:
                os.ftruncate(self._fd, self._size)  # no cut line: truncating needs no space
            except OSError:
                pass
            return
        self._size += done

    def fault(self) -> str | None:
        """Why events can no longer be written (None: they can). Also notices the file gone
        (its run directory removed while the job runs)."""
        with self._lock:
            if self._fault is None and self._closed.alive:
                try:
                    gone = os.fstat(self._fd).st_nlink == 0
                except OSError as exc:
                    gone, self._fault = False, f"{self.path}: {exc.strerror or exc}"
                if gone:
                    self._fault = f"{self.path} was removed while the job ran"
            return self._fault

    def close(self) -> None:
        with self._lock:
            self._closed()


def write_summary(run_dir: str, result: RunResult) -> str:
    path = os.path.join(run_dir, "summary.json")
    tmp = path + ".tmp"
    summary = result.model_dump()
    if summary.get("stop") is None:  # docs/outputs.md: `stop` is written for a stopped job only
        summary.pop("stop", None)
    if summary.get("mean_rows_per_s") is None:  # measured for a TorchTrainer run's loaders only
        summary.pop("mean_rows_per_s", None)
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640), "w") as f:
            json.dump(summary, f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # never a half-written summary beside the run's files
        raise
    return path


def read_events(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _plain(value: Any) -> Any:
    """JSON has no NaN: a non-finite float (a NaN loss) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
