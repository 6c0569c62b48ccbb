"""Reading the ledgers of ``train_api_script`` (one JSONL file per rank and process): when to
kill, and what a run's recovery cost. Pure but for ``read_ledger``; runs in a side's child
process.

The figures, from the workers' own wall-clock stamps (every process is on this machine):

Only the lines of applied steps count (``applied``: the step changed the weights; ours holds
back a step whose all-reduce failed and serves its rows again, and the loop, which counts its
own steps, has counted it: ``steps_not_applied``).

- ``recovery_s``: from ``kill_ts`` (stamped just before the SIGKILL) to the first step
  completed by every rank of the group at the smaller size;
- ``steps_trained_again``: the last step the old group completed (any rank, before or after
  the kill) minus the step the smaller group resumed from (its first step less one): 0 when
  no completed step is trained again;
- rows trained once, twice, never (and more than twice) over the first epoch, counted on
  the run's lineage: for each step number, the latest group that applied it (the world
  size of that step's latest ``step`` line), each of its ranks with the rows of its latest
  ``batch`` line for that step before then (a rank killed inside the step whose gradients
  the survivors applied trained its rows). A step trained again replaces the earlier one,
  as it does in the model;
- with more than one kill, each kill's figures (``recoveries``), and the resident memory of
  the processes that trained after every kill (survivors kept in place: none on Ray Train,
  which starts new workers), at their last step before the next kill: its growth from after
  the first re-entry to after the last (issue 46: within 5 % after 3 re-entries).
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


def kill_target(recs: list[dict[str, Any]], rank: int, world: int) -> tuple[str, list[int]]:
    """The node of ``rank`` in the group of ``world`` ranks (its latest line there), and every
    pid the ledgers saw on that node."""
    mine = [r for r in recs if r["kind"] in ("enter", "step") and r["rank"] == rank and r["world_size"] == world]
    node_id = mine[-1]["node_id"]
    return node_id, sorted({r["pid"] for r in recs if r.get("node_id") == node_id})


def steps_at(recs: list[dict[str, Any]], world: int) -> int:
    """The last step any rank completed in a group of ``world`` ranks (0: none)."""
    return max((r["step"] for r in recs if r["kind"] == "step" and r["world_size"] == world), default=0)


def applied_steps(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step lines of steps that changed the weights (a held-back step is not trained)."""
    return [r for r in recs if r["kind"] == "step" and r.get("applied", True)]


def lineage(recs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Step number -> the ``batch`` lines (one per rank) of the latest group to apply it.

    That group is the world size of the step's latest applied ``step`` line; each of its
    ranks gives its latest ``batch`` line for the step at that size written before then. A
    rank killed after its gradients went into the all-reduce counts too: the survivors'
    step could only complete with them."""
    applied: dict[int, dict[str, Any]] = {}
    for r in applied_steps(recs):
        if r["step"] not in applied or r["ts"] >= applied[r["step"]]["ts"]:
            applied[r["step"]] = r
    batches: dict[tuple[int, int, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in recs:
        if r["kind"] == "batch":
            batches[(r["step"], r["world_size"], r["rank"])].append(r)
    out = {}
    for step, last in applied.items():
        world = last["world_size"]
        lines = []
        for rank in range(world):
            before = [b for b in batches.get((step, world, rank), []) if b["ts"] <= last["ts"]]
            if before:
                lines.append(max(before, key=lambda b: b["ts"]))
        out[step] = lines
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


def recovery(recs: list[dict[str, Any]], kill_ts: float, until_ts: float | None) -> dict[str, Any]:
    """The figures of the kill at ``kill_ts`` from the lines before ``until_ts`` (the next kill)."""
    steps = [r for r in applied_steps(recs) if until_ts is None or r["ts"] < until_ts]
    before = [r for r in steps if r["ts"] <= kill_ts]
    if not before:
        return {}
    old = before[-1]["world_size"]
    out: dict[str, Any] = {"kill_ts": kill_ts, "old_size": old}
    window = [r for r in recs if r["ts"] > kill_ts and (until_ts is None or r["ts"] < until_ts)]
    out["entries_after_kill"] = sum(1 for r in window if r["kind"] == "enter")
    smaller = [r for r in steps if r["ts"] > kill_ts and r["world_size"] < old]
    if not smaller:
        return out
    ws = smaller[0]["world_size"]
    first = min(r["step"] for r in smaller if r["world_size"] == ws)
    done = [r for r in smaller if r["world_size"] == ws and r["step"] == first]
    if len({r["rank"] for r in done}) != ws:  # not completed by every rank of the new group
        return out
    done_ts = max(r["ts"] for r in done)
    out["new_size"] = ws
    out["first_step_at_new_size"] = first
    out["recovery_s"] = done_ts - kill_ts
    out["resume_step"] = first - 1
    reached = max(r["step"] for r in steps if r["world_size"] == old and r["ts"] <= done_ts)
    out["last_step_at_old_size"] = reached
    out["steps_trained_again"] = max(0, reached - (first - 1))
    # Processes of the smaller group that were already training before the kill: kept in place.
    out["survivor_processes_kept"] = len({r["pid"] for r in done} & {r["pid"] for r in recs if r["ts"] <= kill_ts})
    return out


def survivor_memory(recs: list[dict[str, Any]], kill_ts: list[float]) -> dict[str, Any]:
    """Resident memory of the processes that trained after every kill (the survivors kept in
    place): each one's RSS at its last step before the next kill (or the end), per kill, and
    the largest growth from after the first re-entry to after the last."""
    bounds = [*kill_ts, None]
    per_pid: dict[int, list[float]] = {}
    for pid in {r["pid"] for r in recs if r["kind"] == "step"}:
        mine = [r for r in recs if r["kind"] == "step" and r["pid"] == pid]
        after = []
        for lo, hi in zip(bounds, bounds[1:]):
            inside = [r for r in mine if r["ts"] > lo and (hi is None or r["ts"] < hi)]
            after.append(inside[-1]["rss_mb"] if inside and "rss_mb" in inside[-1] else None)
        if all(v is not None for v in after):
            per_pid[pid] = after
    out: dict[str, Any] = {"survivor_rss_mb_after_each_kill": {str(p): v for p, v in sorted(per_pid.items())}}
    if per_pid and len(kill_ts) > 1:
        out["survivor_rss_growth"] = max(v[-1] / v[0] - 1 for v in per_pid.values())
    return out


def analyse(recs: list[dict[str, Any]], kill_ts: list[float], rows: int, steps_per_epoch: int) -> dict[str, Any]:
    """A run's figures (see the module docstring): the first kill's at the top level, every
    kill's in ``recoveries``; what cannot be told is left out."""
    out: dict[str, Any] = {}
    if not any(r["kind"] == "enter" for r in recs):
        return out
    out.update(row_counts(recs, rows, steps_per_epoch))
    out["last_step"] = max((r["step"] for r in recs if r["kind"] == "step"), default=0)
    # Steps the loop counted whose optimizer step changed nothing (held back after a failed all-reduce).
    out["steps_not_applied"] = sorted({r["step"] for r in recs if r["kind"] == "step" and not r.get("applied", True)})
    out["old_size"] = next(r["world_size"] for r in recs if r["kind"] == "enter")
    if not kill_ts:
        return out
    recoveries = [recovery(recs, t, nxt) for t, nxt in zip(kill_ts, [*kill_ts[1:], None])]
    out.update({k: v for k, v in recoveries[0].items() if k != "kill_ts"})
    out["recoveries"] = recoveries
    out.update(survivor_memory(recs, kill_ts))
    return out
