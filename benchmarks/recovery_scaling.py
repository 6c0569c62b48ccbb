"""Does a recovery cost what the lost replica costs, or what the job costs? (issue 29)

The unit is the **re-formation cost**: a recovery's ``downtime_s`` less its ``first_step_s``
(the breakdown's phases before the first step at the new size), so that a bigger model's
longer step does not count. Every scenario is a real elastic run on a local multi-node Ray
cluster (``ray.cluster_utils.Cluster``), a node killed as ``kill_node`` does (SIGKILL of its
raylet's children, then ``remove_node``) when step ``--kill-step`` completes:

- ``tp2pp2_8``, ``tp2pp2_16``: tp 2 x pp 2 replicas, one per node, at 8 and 16 ranks (dp 2
  and 4), one replica lost. Goal: cost(16) / cost(8) <= 1.3.
- ``dp_4``, ``dp_8``, ``dp_16``: pure DP, 2 ranks per node, a node lost (reported, with the
  rendezvous' share: gloo connects the replicate group as a full mesh, O(dp) per rank).
- ``ddp_50mb``, ``ddp_500mb``, ``hsdp_50mb``, ``hsdp_500mb``: 4 ranks, one per node, with
  about 50 MB and about 500 MB of training state (weights and AdamW moments), under DDP and
  under HSDP (zero 3, shard groups of 2). Goal: cost(500 MB) / cost(50 MB) <= 1.2, with the
  survivors' ``restore_s`` near 0 (``ranks_kept_state``: survivors that restored nothing).
  The 500 MB model has twice the blocks of the 50 MB one (8 against 4);
  ``ddp_500mb_4l`` and ``hsdp_500mb_4l`` hold the same state at 4 blocks (wider), so the
  two ratios separate what grows with the bytes from what grows with the module count.

and, without Ray, the store operations per rank per re-formation (a warm re-formation of
spawned gloo ranks through the project's ``ReconfigurableProcessGroup`` and
``ParallelDims.build_mesh``) at 4, 8 and 16 ranks for pure DP and tp 2 x pp 2, side by side
with the world group connected eagerly (a full mesh, the baseline) and lazily (ours).

On 2 cores every rank's work queues behind the others', so the wall-clock cost grows with
the number of ranks even when no rank does more: the most CPU time one worker spent
re-forming (``configure_cpu_s`` of the ``restore`` event) is reported next to it, as the
measure of what a rank costs when it has its own cores.

Each scenario runs ``--reps`` times in a child process (its own Ray cluster, killed at a
deadline); medians and ranges are printed with the machine's load. ``--json`` prints one
JSON object as the last line; ``--out`` (default ``benchmarks/results/recovery_scaling.json``)
keeps it, named and dated, for ``elastic simulate``.

Usage::

    .venv/bin/python -m benchmarks.recovery_scaling [--reps 3] [--scenarios dp_4,dp_8] [--json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.harness.cluster import start_cluster
from benchmarks.harness.kill import PidsGroup, node_index_of
from benchmarks.harness.proc import arm_deadline, child_env, module_command, run_logged, tail
from benchmarks.harness.results import results_path, utc_iso, write_json
from benchmarks.harness.stats import median_range
from benchmarks.harness.store_ops import store_ops_by_world

TINY = {"n_layers": 4, "d_model": 64, "n_heads": 4, "vocab_size": 512, "seq_len": 32}
M50 = {"n_layers": 4, "d_model": 256, "n_heads": 4, "vocab_size": 2048, "seq_len": 32}  # 4.2M params, 50.5 MB
M500 = {"n_layers": 8, "d_model": 640, "n_heads": 8, "vocab_size": 4096, "seq_len": 32}  # 44.6M params, 0.54 GB
# The same state as M500 at M50's depth (4 blocks, wider): what grows with the bytes alone,
# apart from what grows with the number of modules (FSDP's per-parameter set-up, the objects
# a teardown collects).
M500_4L = {"n_layers": 4, "d_model": 864, "n_heads": 8, "vocab_size": 4096, "seq_len": 32}  # 43.0M params, 0.52 GB
# name: (model, tp, pp, zero, shard_group, nodes, ranks per node, global batch)
SCENARIOS: dict[str, tuple[dict, int, int, int, int | None, int, int, int]] = {
    "tp2pp2_8": (TINY, 2, 2, 0, None, 2, 4, 12),
    "tp2pp2_16": (TINY, 2, 2, 0, None, 4, 4, 12),
    "dp_4": (TINY, 1, 1, 0, None, 2, 2, 336),  # 336: every DP degree before and after (4/2, 8/6, 16/14)
    "dp_8": (TINY, 1, 1, 0, None, 4, 2, 336),
    "dp_16": (TINY, 1, 1, 0, None, 8, 2, 336),
    "ddp_50mb": (M50, 1, 1, 0, None, 4, 1, 12),
    "ddp_500mb": (M500, 1, 1, 0, None, 4, 1, 12),
    "hsdp_50mb": (M50, 1, 1, 3, 2, 4, 1, 12),
    "hsdp_500mb": (M500, 1, 1, 3, 2, 4, 1, 12),
    "ddp_500mb_4l": (M500_4L, 1, 1, 0, None, 4, 1, 12),
    "hsdp_500mb_4l": (M500_4L, 1, 1, 3, 2, 4, 1, 12),
}
PRE_STEP = ("detect_s", "decide_s", "free_s", "spawn_s", "rendezvous_s", "rebuild_s", "restore_s", "configure_other_s")
WORKER_SIDE = ("rendezvous_s", "rebuild_s", "restore_s", "configure_other_s")
RESULTS = results_path("recovery_scaling.json")


# --------------------------------------------------------------------------- one run (child)


def spec_dict(name: str, kill_step: int) -> dict[str, Any]:
    model, tp, pp, zero, group, nodes, per_node, batch = SCENARIOS[name]
    dp = nodes * per_node // (tp * pp)
    return {
        "name": f"scaling-{name}",
        "seed": 0,
        "model": dict(model),
        "data": {"source": "synthetic", "num_samples": 4000},
        "parallel": {"tp": tp, "pp": pp, "zero": zero, "shard_group": group, "micro_batch": 1},
        "elastic": {"min_dp": 1, "max_dp": dp, "heartbeat_timeout_s": 60, "collective_timeout_s": 60},
        "resources": {"cpus_per_worker": 1},
        "train": {"steps": kill_step + 3, "global_batch": batch, "lr": 1e-3},
        "checkpoint": {"every_steps": 1000, "memory_every_steps": 1},
    }


def child(cfg: dict[str, Any]) -> None:
    """Run one scenario on its own cluster; write what it measured to ``cfg['out']``."""
    from elastic import ElasticTrainer
    from elastic.control.callbacks import Callback
    from elastic.events import read_events
    from elastic.faults import kill_node
    from jobs import JobSpec

    _, tp, pp, _, _, nodes, per_node, _ = SCENARIOS[cfg["scenario"]]
    out: dict[str, Any] = {"scenario": cfg["scenario"], "load_before": os.getloadavg()[0]}
    arm_deadline(cfg["timeout_s"], cfg["out"], out)  # nothing outlives the budget
    started = start_cluster(nodes, node_cpus=per_node, dashboard=False)
    cluster = started.cluster

    class KillNode(Callback):
        """Kill the last rank's node once ``kill_step`` is done (from a thread: the controller
        is not held by ``remove_node``)."""

        def __init__(self) -> None:
            self.thread: threading.Thread | None = None
            self.kill_ts: float | None = None

        def after_step(self, step: int, group: Any) -> None:
            if self.thread is None and step >= cfg["kill_step"]:
                node = max(group.members, key=lambda m: m.rank).node_id
                holder = PidsGroup({node: [m.pid for m in group.members if m.node_id == node]})
                index = node_index_of(cluster, node)

                def kill() -> None:
                    self.kill_ts = time.time()  # wall clock, as the workers' step stamps
                    kill_node(cluster, index, holder)

                self.thread = threading.Thread(target=kill, daemon=True)
                self.thread.start()

    run_dir = os.path.join(cfg["work"], "run")
    try:
        spec = JobSpec.from_dict(spec_dict(cfg["scenario"], cfg["kill_step"]))
        killer = KillNode()
        result = ElasticTrainer(spec, run_dir=run_dir, callbacks=[killer], progress=False).fit()
        out["status"] = result.status
        rec = result.recoveries[0] if result.recoveries else None
        if rec is not None:
            out["breakdown"] = dict(rec.breakdown)
            out["lost_steps"] = rec.lost_steps
            out["cost_s"] = sum(rec.breakdown.get(k, 0.0) for k in PRE_STEP)
            out["worker_side_s"] = sum(rec.breakdown.get(k, 0.0) for k in WORKER_SIDE)
        restores = [e for e in read_events(run_dir) if e["kind"] == "restore"]
        if restores:
            r = restores[0]
            keys = ("store_ops_per_rank", "ranks_kept_state", "peer_bytes", "source", "configure_cpu_s")
            out.update({k: r.get(k) for k in keys})
        steps = [e for e in read_events(run_dir) if e["kind"] == "step"]
        if killer.kill_ts is not None and restores:  # the same cost, timed from the kill (not the driver's estimate)
            after = [e for e in steps if e["ts"] > restores[0]["ts"]]
            if after:
                first = after[0]
                out["cost_from_kill_s"] = first["ts"] - first["step_time_s"] - killer.kill_ts
                failures = [e for e in read_events(run_dir) if e["kind"] == "failure"]
                out["detect_from_kill_s"] = failures[0]["ts"] - killer.kill_ts if failures else None
        out["step_s"] = statistics.median(e["step_time_s"] for e in steps[1 : cfg["kill_step"]])
        out["ranks"] = (nodes * per_node, nodes * per_node - per_node)
        out["world"] = nodes * per_node
    except Exception as exc:  # reported, not hidden
        out["status"] = f"error: {type(exc).__name__}: {exc}"
        try:  # what the controller saw, to tell a product fault from the machine's
            kinds = ("failure", "resize", "restore", "job_end")
            out["events"] = [e for e in read_events(run_dir) if e["kind"] in kinds][:12]
        except Exception:  # noqa: BLE001 - no events written
            pass
    finally:
        if cfg.get("keep_logs") and started.tmpdir:  # the workers' logs, before the session goes
            for session in glob.glob(os.path.join(started.tmpdir, "**", "session_*", "logs"), recursive=True):
                shutil.copytree(session, os.path.join(cfg["work"], "ray-logs"), dirs_exist_ok=True)
        started.stop()
    out["load_after"] = os.getloadavg()[0]
    write_json(cfg["out"], out)
    os._exit(0)


# --------------------------------------------------------------------------- driver


def run_scenario(name: str, rep: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"scaling-{name}-") as work:
        cfg = {"scenario": name, "work": work, "out": os.path.join(work, "out.json"),
               "kill_step": args.kill_step, "timeout_s": args.timeout_s, "keep_logs": bool(args.logs)}  # fmt: skip
        cmd = module_command("benchmarks.recovery_scaling", "--child", json.dumps(cfg))
        log = os.path.join(work, "child.log")
        rc, wall_s, _ = run_logged(cmd, args.timeout_s + 60, child_env(), log)
        if args.logs:  # the child's log and its Ray session's worker logs, kept
            keep = os.path.join(args.logs, f"{name}-{rep}")
            os.makedirs(keep, exist_ok=True)
            shutil.copy(log, keep)
            for sub in ("ray-logs", "run"):
                if os.path.isdir(os.path.join(work, sub)):
                    shutil.copytree(os.path.join(work, sub), os.path.join(keep, sub), dirs_exist_ok=True)
        try:
            with open(cfg["out"]) as f:
                res = json.load(f)
        except OSError:
            res = {"scenario": name, "status": f"no result (exit {rc}): {tail(log, 8)[-400:]}"}
    res.update(rep=rep, wall_s=round(wall_s, 1))
    cost = res.get("cost_s")
    fk = res.get("cost_from_kill_s")
    print(f"  {name:>11} rep {rep}: {res.get('status')} cost {cost if cost is None else round(cost, 3)}s "
          f"(from the kill {fk if fk is None else round(fk, 3)}s) "
          f"breakdown {res.get('breakdown')} ops/rank {res.get('store_ops_per_rank')} "
          f"kept {res.get('ranks_kept_state')} cpu/rank {res.get('configure_cpu_s')}s "
          f"load {res.get('load_before', 0):.1f}->{res.get('load_after', 0):.1f}", flush=True)  # fmt: skip
    return res


def stats(values: list[float | None]) -> dict[str, float] | None:
    """Median and range (``harness.stats.median_range``), to the millisecond."""
    s = median_range(values)
    return None if s is None else {k: round(v, 3) for k, v in s.items()}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, reps in runs.items():
        ok = [r for r in reps if r.get("status") == "succeeded" and r.get("cost_s") is not None]
        bd = {k: stats([r["breakdown"].get(k) for r in ok]) for k in PRE_STEP + ("first_step_s",)} if ok else {}
        out[name] = {
            "runs": len(reps), "succeeded": len(ok), "cost_s": stats([r["cost_s"] for r in ok]),
            "worker_side_s": stats([r["worker_side_s"] for r in ok]), "breakdown": bd,
            "cost_from_kill_s": stats([r.get("cost_from_kill_s") for r in ok]),
            "detect_from_kill_s": stats([r.get("detect_from_kill_s") for r in ok]),
            "step_s": stats([r.get("step_s") for r in ok]),
            "configure_cpu_s": stats([r.get("configure_cpu_s") for r in ok]),
            "store_ops_per_rank": stats([r.get("store_ops_per_rank") for r in ok]),
            "ranks_kept_state": [r.get("ranks_kept_state") for r in ok],
            "lost_steps": [r.get("lost_steps") for r in ok],
            "load": stats([r.get("load_before") for r in reps]),
        }  # fmt: skip
    return out


def ratio(summary: dict[str, Any], a: str, b: str, key: str = "cost_s") -> float | None:
    x, y = (summary.get(n, {}).get(key) for n in (a, b))
    return round(x["median"] / y["median"], 3) if x and y and y["median"] else None


def goals(summary: dict[str, Any]) -> dict[str, Any]:
    g = {
        "tp2pp2_cost16_over_cost8": ratio(summary, "tp2pp2_16", "tp2pp2_8"),
        "dp_cost16_over_cost4": ratio(summary, "dp_16", "dp_4"),
        "dp_cost8_over_cost4": ratio(summary, "dp_8", "dp_4"),
        "ddp_cost500_over_cost50": ratio(summary, "ddp_500mb", "ddp_50mb"),
        "hsdp_cost500_over_cost50": ratio(summary, "hsdp_500mb", "hsdp_50mb"),
        "ddp_cost500_4l_over_cost50": ratio(summary, "ddp_500mb_4l", "ddp_50mb"),  # the same depth
        "hsdp_cost500_4l_over_cost50": ratio(summary, "hsdp_500mb_4l", "hsdp_50mb"),
        # The same costs timed from the kill (the benchmark's stamp), not from the driver's estimate.
        "tp2pp2_from_kill16_over_8": ratio(summary, "tp2pp2_16", "tp2pp2_8", "cost_from_kill_s"),
        "ddp_from_kill500_over_50": ratio(summary, "ddp_500mb", "ddp_50mb", "cost_from_kill_s"),
        "hsdp_from_kill500_over_50": ratio(summary, "hsdp_500mb", "hsdp_50mb", "cost_from_kill_s"),
        "tp2pp2_worker_side16_over_8": ratio(summary, "tp2pp2_16", "tp2pp2_8", "worker_side_s"),
        "ddp_worker_side500_over_50": ratio(summary, "ddp_500mb", "ddp_50mb", "worker_side_s"),
        "hsdp_worker_side500_over_50": ratio(summary, "hsdp_500mb", "hsdp_50mb", "worker_side_s"),
        # A rank's own CPU work to re-form: on 2 cores every rank's work queues behind the
        # others', so wall-clock grows with the ranks even when no rank does more.
        "tp2pp2_rank_cpu16_over_8": ratio(summary, "tp2pp2_16", "tp2pp2_8", "configure_cpu_s"),
        "dp_rank_cpu16_over_4": ratio(summary, "dp_16", "dp_4", "configure_cpu_s"),
        "ddp_rank_cpu500_over_50": ratio(summary, "ddp_500mb", "ddp_50mb", "configure_cpu_s"),
        "hsdp_rank_cpu500_over_50": ratio(summary, "hsdp_500mb", "hsdp_50mb", "configure_cpu_s"),
    }
    for name in ("dp_4", "dp_8", "dp_16"):  # the share of the gloo full-mesh rendezvous in the cost
        s = summary.get(name, {})
        if s.get("cost_s") and s["breakdown"].get("rendezvous_s"):
            g[f"{name}_rendezvous_share"] = round(s["breakdown"]["rendezvous_s"]["median"] / s["cost_s"]["median"], 3)
    return g


def targets(summary: dict[str, Any], g: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals next to what was measured (``met`` is None where not measured)."""

    def bound(value: float | None, limit: float) -> dict[str, Any]:
        return {"goal": f"<= {limit}", "measured": value, "met": None if value is None else value <= limit}

    state = ("ddp_50mb", "ddp_500mb", "hsdp_50mb", "hsdp_500mb", "ddp_500mb_4l", "hsdp_500mb_4l")
    restore = {n: (summary.get(n, {}).get("breakdown", {}).get("restore_s") or {}).get("median") for n in state}
    # Store operations beyond the replicate (DP) group's full mesh, which gloo connects with
    # one set and one get per member: constant in the number of replicas when only it grows.
    beyond = {}
    for layout, replica in (("dp", 1), ("tp2pp2", 4)):
        rows = [r for r in ops if r["layout"] == layout and r["world_group"] == "lazy"]
        beyond[layout] = {r["world"]: r["store_ops_per_rank"] - 2 * r["world"] // replica for r in rows}
    flat = all(len(set(v.values())) <= 1 for v in beyond.values()) if ops else None
    return {
        "tp2pp2_cost16_over_cost8": bound(g.get("tp2pp2_cost16_over_cost8"), 1.3),
        "ddp_cost500_over_cost50": bound(g.get("ddp_cost500_over_cost50"), 1.2),
        "hsdp_cost500_over_cost50": bound(g.get("hsdp_cost500_over_cost50"), 1.2),
        "ddp_cost500_4l_over_cost50": bound(g.get("ddp_cost500_4l_over_cost50"), 1.2),
        "hsdp_cost500_4l_over_cost50": bound(g.get("hsdp_cost500_4l_over_cost50"), 1.2),
        "survivors_restore_s": {"goal": "near 0", "measured": restore},
        "store_ops_beyond_replicate_group": {
            "goal": "no growth with the number of replicas beyond the backend's replicate group (gloo: 2 per member)",
            "measured": beyond,
            "met": flat,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--kill-step", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--store-ops-worlds", default="4,8,16", help="'' to skip the store-operations part")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--json", action="store_true")
    p.add_argument("--logs", help="keep each run's child log and Ray worker logs under this directory")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    names = [n for n in args.scenarios.split(",") if n]
    print(f"recovery scaling: {args.reps} rep(s) of {names}, node killed after step {args.kill_step}; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.reps):  # interleaved: a change in the machine's load hits every scenario alike
        for name in names:
            runs[name].append(run_scenario(name, rep, args))
    worlds = [int(w) for w in args.store_ops_worlds.split(",") if w]
    ops = store_ops_by_world(worlds) if worlds else []
    summary = summarise(runs)
    result = {
        "benchmark": "recovery_scaling",
        "measured_at": utc_iso(),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "backend": "gloo (CPU)"},
        "kill_step": args.kill_step, "reps": args.reps, "scenarios": summary, "goals": goals(summary),
        "targets": targets(summary, goals(summary), ops),
        "store_ops": ops, "runs": runs,
    }  # fmt: skip
    print("\nre-formation cost (downtime - first step), median [min, max]:")
    for name, s in summary.items():
        c = s["cost_s"]
        print(f"  {name:>11}: {c and c['median']}s [{c and c['min']}, {c and c['max']}] "
              f"worker side {s['worker_side_s'] and s['worker_side_s']['median']}s, "
              f"cpu/rank {s['configure_cpu_s'] and s['configure_cpu_s']['median']}s, "
              f"kept {s['ranks_kept_state']}, load {s['load'] and s['load']['median']}")  # fmt: skip
    print("ratios:", json.dumps(result["goals"]))
    if args.out:
        write_json(args.out, result, indent=1)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
