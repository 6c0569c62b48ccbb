"""Reading the ledgers of ``train_api_script`` (one JSONL file per rank and process): when to
kill, and what a run's recovery cost. Pure but for ``read_ledger``; runs in a side's child
process.

The figures, from the workers' own wall-clock stamps (every process is on this machine):

- ``recovery_s``: from ``kill_ts`` (stamped just before the SIGKILL) to the first step
  completed by every rank of the group at the smaller size;
- ``steps_trained_again``: the last step the old group completed (any rank, before or after
  the kill) minus the step the smaller group resumed from (its first step less one): 0 when
  no completed step is trained again;
- rows trained once, twice, never (and more than twice) over the first epoch, counted on
  the run's lineage: for each step number, the latest group that completed it (the world
  size of that step's latest line), each of its ranks with its latest line of that step. A
  step trained again replaces the earlier one, as it does in the model.
"""

from __future__ import annotations

import collections
import glob
import json
import os
from typing import Any


def read_ledger(directory: str) -> list[dict[str, Any]]:
    """Every line of every ledger file under ``directory``, by time (a line being written is left out)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        try:
            with open(path) as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return sorted(out, key=lambda r: r["ts"])


def last_step(recs: list[dict[str, Any]]) -> int:
    return max((r["step"] for r in recs if r["kind"] == "step"), default=0)


def kill_target(recs: list[dict[str, Any]], rank: int) -> tuple[str, list[int]]:
    """The node of ``rank`` in the latest group (its latest ``enter`` line), and the pids known there."""
    enters = [r for r in recs if r["kind"] == "enter"]
    node_id = [r for r in enters if r["rank"] == rank][-1]["node_id"]
    return node_id, sorted({r["pid"] for r in enters if r["node_id"] == node_id})


def lineage(recs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Step number -> the lines of the latest group to complete it, one per rank."""
    by_step: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in recs:
        if r["kind"] == "step":
            by_step[r["step"]].append(r)
    out = {}
    for step, lines in by_step.items():
        world = max(lines, key=lambda r: r["ts"])["world_size"]
        latest: dict[int, dict[str, Any]] = {}
        for r in lines:
            if r["world_size"] == world and r["rank"] < world:
                if r["rank"] not in latest or r["ts"] >= latest[r["rank"]]["ts"]:
                    latest[r["rank"]] = r
        out[step] = [latest[k] for k in sorted(latest)]
    return out


def row_counts(recs: list[dict[str, Any]], rows: int, steps_per_epoch: int) -> dict[str, Any]:
    """Rows of the first epoch (steps 1..``steps_per_epoch``) trained once, twice, never and
    more, on the lineage; ``epoch_steps_done`` says how many of its steps the lineage has."""
    counts = [0] * rows
    steps = lineage(recs)
    for step in range(1, steps_per_epoch + 1):
        for r in steps.get(step, []):
            for i in r["rows"]:
                counts[i] += 1
    hist = collections.Counter(min(c, 3) for c in counts)
    return {
        "rows": rows,
        "rows_once": hist[1],
        "rows_twice": hist[2],
        "rows_never": hist[0],
        "rows_more": hist[3],
        "epoch_steps_done": sum(1 for s in range(1, steps_per_epoch + 1) if s in steps),
    }


def analyse(recs: list[dict[str, Any]], kill_ts: float | None, rows: int, steps_per_epoch: int) -> dict[str, Any]:
    """A run's figures (see the module docstring); what cannot be told is left out."""
    out: dict[str, Any] = {}
    steps = [r for r in recs if r["kind"] == "step"]
    enters = [r for r in recs if r["kind"] == "enter"]
    if not enters:
        return out
    out.update(row_counts(recs, rows, steps_per_epoch))
    out["last_step"] = last_step(recs)
    old = enters[0]["world_size"]
    out["old_size"] = old
    if kill_ts is None:
        return out
    out["entries_after_kill"] = len([r for r in enters if r["ts"] > kill_ts])
    smaller = [r for r in steps if r["ts"] > kill_ts and r["world_size"] < old]
    if not smaller:
        return out
    ws = smaller[0]["world_size"]
    first = min(r["step"] for r in smaller if r["world_size"] == ws)
    done = [r for r in smaller if r["world_size"] == ws and r["step"] == first]
    if len({r["rank"] for r in done}) != ws:  # not completed by every rank of the new group
        return out
    out["new_size"] = ws
    out["first_step_at_new_size"] = first
    out["recovery_s"] = max(r["ts"] for r in done) - kill_ts
    out["resume_step"] = first - 1
    reached = max(r["step"] for r in steps if r["world_size"] == old)
    out["last_step_at_old_size"] = reached
    out["steps_trained_again"] = max(0, reached - (first - 1))
    # Processes of the smaller group that were already training before the kill: kept in place.
    before = {r["pid"] for r in enters if r["ts"] <= kill_ts}
    group = {r["pid"] for r in done}
    out["survivor_processes_kept"] = len(group & before)
    return out
