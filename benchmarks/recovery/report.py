"""What the recovery benchmark reports: per-run lines, medians and ranges per side, the
ratios against ours, and the results file (``benchmarks/results/recovery.json`` by default,
read by ``elastic demo``, ``elastic simulate`` and the docs: its layout is fixed). Runs in the
benchmark's driver process.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from typing import Any

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.results import package_version, utc_stamp, write_json
from benchmarks.harness.stats import fmt, fmt_summary, summary
from benchmarks.recovery.scenario import (
    GLOBAL_BATCH,
    MICRO_BATCH,
    MODEL,
    NODES,
    RAY_TUNED_ENV,
    RAY_TUNED_SYSTEM_CONFIG,
    TORCHFT_HEARTBEAT_TIMEOUT_MS,
    TORCHFT_JOIN_TIMEOUT_MS,
    TORCHFT_SIDES,
)

BASELINES = ("raytrain_tuned", "raytrain_default", "torchft", "raytrain_torchft")
DEFINITIONS = {
    "recovery_s": "kill_ts (stamped by the benchmark just before SIGKILL) -> the first step "
    "completed "
    "by every rank at the smaller size, from the workers' own per-step timestamps",
    "lost_steps": "the last step any worker completed before the recovery minus the step training resumed from",
    "steady_step_at_new_size_s": "median interval between the completions of the steps at the smaller size",
    "recovery_less_step_s": "recovery_s less steady_step_at_new_size_s: the recovery without the first step's "
    "own work, which differs between sides (rows_per_worker_at_new_size: ours and Ray Train keep the global "
    "batch, so each survivor trains more rows; a TorchFT replica keeps its rows and the global batch shrinks)",
}
FIRST_STEP_KEYS = ("steady_step_at_new_size_s", "recovery_less_step_s", "rows_per_worker_at_new_size")


def _fmt_bd(bd: dict[str, float] | None) -> str:
    if not bd:
        return "n/a"
    return ", ".join(f"{k} {v:.2f}" for k, v in bd.items())


def print_run(side: str, r: dict[str, Any]) -> None:
    print(
        f"  {side}: status {r.get('status')}, recovery {fmt(r.get('recovery_s'))} s, lost steps "
        f"{fmt(r.get('lost_steps'), 'd')}, breakdown {_fmt_bd(r.get('breakdown'))}, wall "
        f"{r['wall_s']:.0f} s, "
        f"load {r['loadavg_1m_after']:.2f}"
        + (
            f", completed {r.get('completed', False)} ({r.get('completion_reason')})"
            if side == "raytrain_torchft"
            else ""
        ),
        flush=True,
    )
    if "recovery_s" not in r:
        print(
            f"  {side}: no step at a smaller size was measured; {r.get('error', '')}\n{r.get('log_tail', '')}",
            flush=True,
        )
    if r.get("status") not in ("succeeded", "skipped"):
        for f in r.get("failures", []):  # why each re-formation happened (the product's failure events)
            print(f"    failure {f['cause']} ranks {f['ranks']}: {f['detail'][:200]}", flush=True)
        if r.get("evidence_dir"):
            print(f"    evidence kept: {r['evidence_dir']}", flush=True)


def _ours_extras(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the product itself reported in summary.json, on the driver's clock."""
    from elastic.control.timing import PHASES

    def rec(r: dict[str, Any]) -> dict[str, Any]:
        return r.get("summary_recovery") or {}

    phases = [k for k in PHASES if any(k in (rec(r).get("breakdown") or {}) for r in runs)]
    return {
        "summary_json": {
            k: summary([rec(r).get(k) for r in runs]) for k in ("detect_s", "recover_s", "downtime_s", "lost_steps")
        },
        "phases": {k: summary([(rec(r).get("breakdown") or {}).get(k) for r in runs]) for k in phases},
    }


def summarise(res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side, runs in res.items():
        s: dict[str, Any] = {
            "recovery_s": summary([r.get("recovery_s") for r in runs]),
            "lost_steps": summary([r.get("lost_steps") for r in runs]),
            "statuses": [r.get("status") for r in runs],
        }
        for k in FIRST_STEP_KEYS:
            if any(k in r for r in runs):
                s[k] = summary([r.get(k) for r in runs])
        keys = sorted({k for r in runs for k in (r.get("breakdown") or {})})
        s["breakdown"] = {k: summary([(r.get("breakdown") or {}).get(k) for r in runs]) for k in keys}
        if any("rejoin_s" in r for r in runs):
            s["rejoin_s"] = summary([r.get("rejoin_s") for r in runs])
            s["add_node_s"] = summary([r.get("add_node_s") for r in runs])
        if side == "ours":
            s.update(_ours_extras(runs))
        if side == "raytrain_torchft":
            s["completed"] = [r.get("completed", False) for r in runs]
            s["completion_reasons"] = [r.get("completion_reason") for r in runs]
            s["replacement_solo_steps"] = [r.get("replacement_solo_steps") for r in runs]
            s["replacement_started_after_node_added_s"] = summary(
                [r.get("replacement_started_after_node_added_s") for r in runs]
            )
        if side in TORCHFT_SIDES and all(r.get("status") == "skipped" for r in runs):
            s["skipped"] = runs[0].get("error")
        out[side] = s
    return out


def ratios(summ: dict[str, Any]) -> dict[str, float]:
    out = {}
    o = summ.get("ours", {}).get("recovery_s")
    for base in BASELINES:
        b = summ.get(base, {}).get("recovery_s")
        if o and b:
            out[f"ours/{base}"] = o["median"] / b["median"]
        o_less = summ.get("ours", {}).get("recovery_less_step_s")
        b_less = summ.get(base, {}).get("recovery_less_step_s")
        if o_less and b_less and b_less["median"] > 0:
            out[f"ours/{base}_less_step"] = o_less["median"] / b_less["median"]
    return out


def print_side(side: str, s: dict[str, Any]) -> None:
    if s.get("skipped"):
        print(f"{side:17s} skipped: {s['skipped']}")
        return
    print(
        f"{side:17s} recovery {fmt_summary(s['recovery_s'])}; lost steps "
        f"{fmt_summary(s['lost_steps'], 'step(s)', '.0f')}"
        + (f"; node added back -> first step at full size {fmt_summary(s['rejoin_s'])}" if s.get("rejoin_s") else "")
    )
    if s.get("recovery_less_step_s"):
        print(
            f"{'':19s}less a steady step at the smaller size ({fmt_summary(s['steady_step_at_new_size_s'])}, "
            f"{fmt_summary(s['rows_per_worker_at_new_size'], 'rows per worker', '.0f')}): "
            f"{fmt_summary(s['recovery_less_step_s'])}"
        )
    if "completed" in s:
        done = sum(1 for c in s["completed"] if c)
        print(f"{'':19s}job completed in {done} of {len(s['completed'])} run(s)")
        for reason in s["completion_reasons"]:
            print(f"{'':21s}{reason}")
        late = fmt_summary(s["replacement_started_after_node_added_s"])
        print(
            f"{'':19s}replacement replica group: started {late}"
            f" after the node was back; steps it trained alone (quorum of 1) per run: "
            f"{s['replacement_solo_steps']}"
        )
    for k, v in s["breakdown"].items():
        print(f"{'':19s}{k:34s} {fmt_summary(v)}")
    if s.get("summary_json"):
        print(
            f"{'':19s}summary.json (driver clock): "
            + ", ".join(
                f"{k} {fmt_summary(v, 'step(s)', '.0f') if k == 'lost_steps' else fmt_summary(v)}"
                for k, v in s["summary_json"].items()
            )
        )
    if s.get("phases"):
        print(f"{'':19s}where our downtime went (summary.json recoveries[0].breakdown, driver clock):")
        for k, v in s["phases"].items():
            print(f"{'':21s}{k:32s} {fmt_summary(v)}")


def print_summary(sides: list[str], summ: dict[str, Any], rat: dict[str, float]) -> None:
    print(
        "\nrecovery = from the SIGKILL to the first step completed by every rank at the smaller size; lost steps = "
        "the last step any worker completed minus the step training resumed from"
    )
    for side in sides:
        print_side(side, summ[side])
    print()
    for k, v in rat.items():
        head = "  <- headline" if k == "ours/raytrain_tuned" else ""
        print(f"ratio {k} = {v:.3f} (medians){head}")


def versions(res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    import ray
    import torch

    # torchft as the TorchFT runs imported it (it may come from --torchft-path, not this process).
    tft = next((r["torchft_version"] for r in res.get("torchft", []) if r.get("torchft_version")), None)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "torchft": tft or package_version("torchft"),
    }


def scenario(args: argparse.Namespace, state_mb: float) -> dict[str, Any]:
    return {
        "nodes": NODES,
        "model": MODEL,
        "state_mb": round(state_mb, 1),
        "global_batch": GLOBAL_BATCH,
        "micro_batch": MICRO_BATCH,
        "steps": args.steps,
        "steps_ours_torchft": args.rejoin_steps if args.return_delay >= 0 else args.steps,
        "kill_step": args.kill_step,
        "kill_rank": args.kill_rank,
        "reps": args.reps,
        "return_delay_s": args.return_delay,
        "raytrain_tuned": {"env": RAY_TUNED_ENV, "system_config": RAY_TUNED_SYSTEM_CONFIG, "checkpoint_every": 1},
        "raytrain_default": {"checkpoint_every": 5},
        "raytrain_torchft": {
            "torch_config": "TorchftConfig(backend='gloo')",
            "replica_groups": NODES,
            "workers_per_replica_group": 1,
            "lighthouse_min_replicas": 1,
            "lighthouse_heartbeat_timeout_ms": TORCHFT_HEARTBEAT_TIMEOUT_MS,
            "lighthouse_join_timeout_ms": TORCHFT_JOIN_TIMEOUT_MS,
            "max_failures": 3,
            "rows_per_replica": GLOBAL_BATCH // NODES,
        },
        "torchft": {
            "lighthouse_heartbeat_timeout_ms": TORCHFT_HEARTBEAT_TIMEOUT_MS,
            "lighthouse_join_timeout_ms": TORCHFT_JOIN_TIMEOUT_MS,
            "rows_per_replica": GLOBAL_BATCH // NODES,
        },
    }


def write_results(
    path: str,
    args: argparse.Namespace,
    started: datetime.datetime,
    state_mb: float,
    res: dict[str, list[dict[str, Any]]],
    summ: dict[str, Any],
    rat: dict[str, float],
) -> None:
    slim = {s: [{k: v for k, v in r.items() if k not in ("log_tail",)} for r in runs] for s, runs in res.items()}
    write_json(
        path,
        {
            "benchmark": "benchmarks/recovery_vs_raytrain.py",
            "date_utc": utc_stamp(started),
            "finished_utc": utc_stamp(),
            "host": {
                "hostname": platform.node(),
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "loadavg_at_start_note": "other processes shared the CPUs; see loadavg_1m_after per run",
            },
            "versions": versions(res),
            "scenario": scenario(args, state_mb),
            "definitions": DEFINITIONS,
            "summary": summ,
            "ratios": rat,
            "runs": slim,
        },
    )
    print(f"results written to {os.path.relpath(os.path.abspath(path), REPO_ROOT)}")
