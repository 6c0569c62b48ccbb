"""Side ``ours``: ``ElasticTrainer`` (``min_dp=1, max_dp=4``), memory snapshots every step,
storage checkpoints every 5 steps, Ray at its defaults (the controller does not wait on Ray's
node table). A node is added back 1 s after the first step at the new size, to time the
grow-back (``rejoin_s``: from the node being up to the first step at full size).

Runs in the side's child process: the cluster, the trainer's controller and the kill thread.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from benchmarks.harness.cluster import start_cluster
from benchmarks.harness.kill import add_node_now, kill_node_now, rejoin_figures
from benchmarks.harness.proc import arm_deadline
from benchmarks.harness.results import write_json
from benchmarks.recovery.scenario import GLOBAL_BATCH, NODES, first_step_work
from elastic.control.callbacks import Callback


class KillAndReturn(Callback):
    """Controller callback. When step ``k`` completes, a driver thread kills the node that
    hosts ``rank`` (the controller is not blocked by ``remove_node``); after the first step
    at the smaller DP, a node is added back to time the grow-back."""

    def __init__(self, cluster, out: dict[str, Any], at_step: int, rank: int, return_delay_s: float):
        self.cluster, self.out, self.at_step, self.rank = cluster, out, at_step, rank
        self.return_delay_s = return_delay_s
        self.old_dp: int | None = None
        self.threads: list[threading.Thread] = []
        self.returned = False

    def after_step(self, step: int, group: Any) -> None:
        if self.old_dp is None:
            self.old_dp = group.dp
        if "kill_requested" not in self.out and step >= self.at_step:
            member = next(m for m in group.members if m.rank == self.rank)
            pids = [m.pid for m in group.members if m.node_id == member.node_id]
            self.out["kill_requested"] = True
            self.out["step_at_kill"] = step
            t = threading.Thread(target=kill_node_now, args=(self.out, self.cluster, member.node_id, pids), daemon=True)
            t.start()
            self.threads.append(t)
        elif "kill_done_ts" in self.out and not self.returned and group.dp < self.old_dp and self.return_delay_s >= 0:
            # Ray starts nodes from the main thread only (signal handlers): the controller's
            # thread, here. Workers keep training meanwhile; the rejoin is timed from the
            # moment the node is up.
            due = self.out.setdefault("return_due_ts", time.time() + self.return_delay_s)
            if time.time() >= due:
                self.returned = True
                add_node_now(self.out, self.cluster, num_cpus=1)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.created:.3f} {record.getMessage()}")


def ours_child(cfg: dict[str, Any]) -> None:
    from elastic import ElasticTrainer
    from elastic.events import read_events
    from jobs import JobSpec

    out: dict[str, Any] = {"side": "ours"}
    arm_deadline(cfg["side_timeout"], cfg["out"], out)
    with open(cfg["spec"]) as f:
        spec = JobSpec.from_dict(json.load(f))
    run_dir = os.path.join(cfg["work"], "run")
    records = _Records()
    ctl_log = logging.getLogger("elastic.control.controller")
    ctl_log.addHandler(records)
    ctl_log.setLevel(logging.INFO)
    t0 = time.time()
    started = start_cluster(NODES)
    out["cluster_start_s"] = time.time() - t0
    cb = KillAndReturn(started.cluster, out, cfg["kill_step"], cfg["kill_rank"], cfg["return_delay_s"])
    try:
        result = ElasticTrainer(spec, run_dir=run_dir, callbacks=[cb], progress=False).fit()
        out["status"] = result.status
        out["summary"] = result.model_dump()
    except Exception as exc:  # report, do not hide: the figures below say what happened
        out["status"] = "error"
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for t in cb.threads:
            t.join(timeout=60)
        started.stop()
    out.pop("kill_requested", None)
    out["controller_log"] = [line for line in records.lines if "recovery phases" in line or "grew" in line]
    events = read_events(run_dir) if os.path.exists(os.path.join(run_dir, "events.jsonl")) else []
    out.update(analyse_ours(events, out))
    write_json(cfg["out"], out)
    os._exit(0)


def analyse_ours(events: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    kill_ts = out.get("kill_ts")
    steps = [e for e in events if e["kind"] == "step"]
    if not steps or kill_ts is None:
        return res
    old_dp = steps[0]["dp"]
    res["old_size"] = old_dp
    res["last_step_before_kill"] = max((e["step"] for e in steps if e["ts"] <= kill_ts), default=0)
    failures = [e for e in events if e["kind"] == "failure" and e["ts"] >= kill_ts]
    shrink = next(
        (e for e in events if e["kind"] == "resize" and e["ts"] >= kill_ts and e["new_dp"] < e["old_dp"]), None
    )
    if shrink is None:
        return res
    new_dp = shrink["new_dp"]
    restores = [e for e in events if e["kind"] == "restore" and e["ts"] >= kill_ts]
    # The step events carry ``ts`` = the workers' own ``done_at`` (the latest rank's).
    after = [e for e in steps if e["ts"] > kill_ts and e["dp"] == new_dp]
    res["new_size"] = new_dp
    if not after:
        return res
    first = after[0]
    res["first_step_at_new_size"] = first["step"]
    res["recovery_s"] = first["ts"] - kill_ts
    res.update(first_step_work(res["recovery_s"], [(e["step"], e["ts"]) for e in after], GLOBAL_BATCH // new_dp))
    r = restores[0] if restores else None
    if r is not None:
        res["resume_step"] = r["step"]
        res["restore_source"] = r["source"]
    recs = (out.get("summary") or {}).get("recoveries") or []
    if recs:
        res["lost_steps"] = recs[0]["lost_steps"]
        res["summary_recovery"] = recs[0]
    bd: dict[str, float] = {}
    if failures:
        bd["detect"] = failures[0]["ts"] - kill_ts
    if r is not None and failures:
        # failure -> restore event: free survivors, drop replicas, rendezvous, rebuild, restore.
        bd["reconfigure_excl_restore"] = r["ts"] - failures[0]["ts"] - r["duration_s"]
        bd["state_restore"] = r["duration_s"]
        bd["first_step"] = first["ts"] - r["ts"]
    res["breakdown"] = bd
    grow = next((e for e in events if e["kind"] == "resize" and e["ts"] > first["ts"] and e["new_dp"] > new_dp), None)
    if grow is not None and out.get("node_added_done_ts"):
        back = [e for e in steps if e["ts"] > grow["ts"] and e["dp"] == grow["new_dp"]]
        if back:
            note = (
                "node up (Cluster.add_node returned) -> first step completed at the full size (a new "
                "worker actor spawned, state sent from a live peer's memory)"
            )
            res.update(rejoin_figures(out, back[0]["ts"], note))
    return res
