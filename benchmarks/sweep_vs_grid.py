"""``elastic sweep`` against the exhaustive grid (``--exhaustive``), side by side in one run.

Both sides search the same space of the same job on the same embedded local Ray (2 worker
slots: one trial at a time on this 2-core machine, so trials do not slow each other; always
its own, never a running cluster that another process started on the machine). The
grid measures every feasible configuration for ``--trial-steps`` steps; the sweep screens
one configuration per (dp, tp, pp, zero) group, refines the best group, and stops slow
trials early (ASHA). Runs are ordered sweep, grid, sweep, ... so that drift in the load of
a shared machine falls on both sides.

Printed, per sweep run and as median [min, max] over the sweep runs:

* best: the sweep's best tokens/s over the grid's best (goal >= 0.95). Also the grid's own
  measurement of the configuration the sweep chose over the grid's best (the quality of the
  choice, free of run-to-run noise);
* time: the sweep's total trial time over the grid's (goal <= 1/3), as the sum of the
  trials' own seconds (``trial_s``) and as the wall time of the whole search;
* memory: measured peak over the memory model's prediction - 1, for every trial that ran
  (goal within +-15%).

The space (why layouts differ in speed here): micro-batch (per-micro-batch overhead and
matmul size), recomputation (one more forward per block), ZeRO 0-3 (DDP buckets vs FSDP
all-gathers and reduce-scatters over gloo) and DP vs TP vs PP (gloo collectives per layer
for TP, a pipeline bubble for PP).

Usage::

    .venv/bin/python -m benchmarks.sweep_vs_grid [--trial-steps 10] [--sweeps 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

from benchmarks.harness.results import results_path, utc_stamp, write_json

SPEC = {
    "name": "sweepbench",
    "model": {"kind": "gpt", "n_layers": 4, "d_model": 128, "n_heads": 4, "vocab_size": 512, "seq_len": 64},
    "data": {"source": "synthetic", "num_samples": 4000},
    "parallel": {"tp": 1, "pp": 1, "zero": 0, "micro_batch": 4},
    "elastic": {"min_dp": 1, "max_dp": 2, "heartbeat_timeout_s": 30, "collective_timeout_s": 60},
    "train": {"steps": 100, "global_batch": 16},
}
SPACE = {
    "tp": [1, 2],
    "pp": [1, 2],
    "zero": [0, 1, 2, 3],
    "micro_batch": [2, 4, 8],
    "activation_checkpointing": [False, True],
}
# --smoke (the test suite's run, tests/test_benchmarks_run.py): every phase of both sides on a
# 2-configuration space of a 1-layer model; it checks the plumbing, its figures mean nothing.
SMOKE_MODEL = {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 128, "seq_len": 16}
SMOKE_SPACE = {"tp": [1], "pp": [1], "zero": [0, 1], "micro_batch": [4], "activation_checkpointing": [False]}


def spec_and_space(smoke: bool) -> tuple[dict, dict]:
    """The job and the space a run searches (``--smoke``: the suite's)."""
    return ({**SPEC, "model": {**SPEC["model"], **SMOKE_MODEL}}, SMOKE_SPACE) if smoke else (SPEC, SPACE)


def run_side(exhaustive: bool, trial_steps: int, out: str, smoke: bool = False) -> dict:
    from elastic.tune.api import run_sweep
    from jobs.spec import JobSpec

    spec, space = spec_and_space(smoke)
    run_sweep(JobSpec.from_dict(spec), space, trial_steps=trial_steps,
              exhaustive=exhaustive, out=out, progress=True, address="local")  # fmt: skip
    return read_side(out, exhaustive)


def read_side(out: str, exhaustive: bool) -> dict:
    """A finished side from its files: ``results.json``; the search's wall time runs from
    ``sweep.json`` (written as the search starts) to ``results.json`` (when it ends)."""
    from elastic.tune.report import best_entry
    from elastic.tune.space import config_key

    with open(os.path.join(out, "results.json")) as f:
        entries = json.load(f)
    best = best_entry(entries)
    ran = [e for e in entries if e.get("trial_s")]
    wall = os.path.getmtime(os.path.join(out, "results.json")) - os.path.getmtime(os.path.join(out, "sweep.json"))
    return {
        "exhaustive": exhaustive,
        "out": out,
        "search_wall_s": wall,
        "trials": len(ran),
        "feasible": sum(1 for e in entries if e["status"] not in ("pruned_memory", "pruned_batch")),
        "trial_s_total": sum(e["trial_s"] for e in ran),
        "best": config_key(best["config"]) if best else None,
        "best_tokens_per_s": best["tokens_per_s"] if best else None,
        "mem_errors": [e["peak_mem_bytes"] / e["predicted_mem_bytes"] - 1 for e in ran if e.get("peak_mem_bytes")],
        "entries": entries,
    }


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trial-steps", type=int, default=10)
    ap.add_argument("--sweeps", type=int, default=2, help="sweep runs (the grid runs once, after the first)")
    ap.add_argument("--json", default=results_path("sweep_vs_grid.json"))
    ap.add_argument("--summarize", default=None, metavar="ROOT", help="only report the finished runs under ROOT")
    ap.add_argument("--smoke", action="store_true", help="a 1-layer model over a 2-configuration space (the suite's)")
    args = ap.parse_args(argv)
    from elastic.tune.space import config_key

    if args.summarize:
        runs = []
        for name in sorted(os.listdir(args.summarize)):
            if os.path.exists(os.path.join(args.summarize, name, "results.json")):
                runs.append(read_side(os.path.join(args.summarize, name), name.endswith("grid")))
    else:
        root = tempfile.mkdtemp(prefix="sweep_vs_grid-")
        order = [False] + [True] + [False] * (args.sweeps - 1)
        runs = []
        for i, exhaustive in enumerate(order):
            side = "grid" if exhaustive else "sweep"
            print(f"=== run {i + 1}/{len(order)}: {side}", flush=True)
            runs.append(run_side(exhaustive, args.trial_steps, os.path.join(root, f"{i}-{side}"), args.smoke))
    grid = next(r for r in runs if r["exhaustive"])
    sweeps = [r for r in runs if not r["exhaustive"]]
    grid_tps = {config_key(e["config"]): e["tokens_per_s"] for e in grid["entries"] if e["status"] == "ok"}
    rows = []
    for s in sweeps:
        rows.append(
            {
                "best_ratio": s["best_tokens_per_s"] / grid["best_tokens_per_s"],
                "choice_ratio": grid_tps.get(s["best"], 0.0) / grid["best_tokens_per_s"],
                "trial_time_ratio": s["trial_s_total"] / grid["trial_s_total"],
                "wall_ratio": s["search_wall_s"] / grid["search_wall_s"],
                "sweep_best": s["best"],
                "sweep_trials": s["trials"],
            }
        )
    mem = [x for r in runs for x in r["mem_errors"]]
    print()
    print(
        f"space: {grid['feasible']} feasible configurations; "
        f"grid best {grid['best']} {grid['best_tokens_per_s']:.0f} tok/s"
    )
    for s in sweeps:
        print(
            f"sweep: best {s['best']} {s['best_tokens_per_s']:.0f} tok/s, {s['trials']} trials, "
            f"{s['trial_s_total']:.0f}s of trials (grid {grid['trial_s_total']:.0f}s, {grid['trials']} trials)"
        )
    print(f"sweep best / grid best tokens/s           = {med([r['best_ratio'] for r in rows])} (goal >= 0.95)")
    print(f"grid's figure for the sweep's pick / best = {med([r['choice_ratio'] for r in rows])}")
    print(f"sweep / grid total trial time             = {med([r['trial_time_ratio'] for r in rows])} (goal <= 0.333)")
    print(f"sweep / grid wall time of the search      = {med([r['wall_ratio'] for r in rows])}")
    worst = max(mem, key=abs) if mem else float("nan")
    inside = sum(1 for x in mem if abs(x) <= 0.15)
    print(
        f"memory model vs measured peak: {inside}/{len(mem)} trials within +-15%, worst {worst * 100:+.1f}%, "
        f"median |error| {statistics.median([abs(x) for x in mem]) * 100:.1f}%"
    )
    searched = spec_and_space(args.smoke)
    record = {
        "date_utc": utc_stamp(),
        "host": platform.node(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "cores": os.cpu_count(),
        "note": "shared machine: other jobs ran at the same time",
        "load_average_at_end": list(os.getloadavg()),
        "trial_steps": args.trial_steps,
        "smoke": args.smoke,
        "spec": searched[0],
        "space": searched[1],
        "feasible": grid["feasible"],
        "grid": {k: v for k, v in grid.items() if k != "entries"},
        "sweeps": [{k: v for k, v in s.items() if k != "entries"} for s in sweeps],
        "ratios": rows,
        "memory_errors": mem,
        "memory_within_15pct": f"{inside}/{len(mem)}",
        "entries": {f"{i}-{'grid' if r['exhaustive'] else 'sweep'}": r["entries"] for i, r in enumerate(runs)},
    }
    write_json(args.json, record, indent=1, newline=False)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
