"""Per-step progress lines of the baselines' workers (Ray Train, TorchFT): each worker
appends one JSON line per event to a shared file, and the side's driver thread reads it to
know when to kill a node. Runs in the workers (append) and in the side's child process (read,
and the side's inputs and its skipped result).
"""

from __future__ import annotations

import json
import os
from typing import Any, NoReturn

from benchmarks.harness.kill import kill_node_now
from benchmarks.harness.results import write_json


def append_line(path: str, rec: dict[str, Any]) -> None:
    """One JSON line, appended atomically (O_APPEND, a single write)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


def read_progress(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written right now
            pass
    return out


def kill_rank_node(out: dict, cluster, recs: list[dict], rank: int, step: int) -> None:
    """Kill the node that hosts ``rank`` (from the workers' own start records) after ``step``."""
    starts = {r["rank"]: r for r in recs if r["kind"] == "start"}
    node_id = starts[rank]["node_id"]
    pids = [r["pid"] for r in recs if r["kind"] == "start" and r["node_id"] == node_id]
    out["step_at_kill"] = step
    kill_node_now(out, cluster, node_id, pids)


def side_inputs(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """In a side's child: the job spec (as JSON) and the progress file its workers append to."""
    with open(cfg["spec"]) as f:
        spec = json.load(f)
    return spec, os.path.join(cfg["work"], "progress.jsonl")


def report_skipped(cfg: dict[str, Any], out: dict[str, Any], what: str, exc: Exception) -> NoReturn:
    """A side that cannot run here (``what`` is not importable): say so in its result, and end."""
    out.update(status="skipped", error=f"{what} is not importable: {type(exc).__name__}: {exc}")
    write_json(cfg["out"], out)
    os._exit(0)
