"""The figures of ``benchmarks/overhead.py`` from its runs: the like-for-like check (both
sides trained the same per-step losses), tokens/s and CPU per step, the paired ratios, the
printed table and the JSON. Runs in the benchmark's driver process.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from benchmarks.harness.results import utc_stamp, write_json

LOSS_RTOL = 1e-5  # same math and data order on both sides; only the loss mean's summation order differs
MIN_WINDOW_S = 5.0  # a steady window shorter than this is too short for a stable slope on a noisy machine
GOAL = 0.97
RUN_KEYS = (
    "rep",
    "side",
    "s_per_step",
    "tokens_per_s",
    "s_per_step_robust",
    "median_step_time_s",
    "wall_s",
    "load",
    "window_steps",
    "window_s",
    "cpu_per_step_s",
    "job_cpu_per_step_s",
    "first_step_s",
)


def check_losses(runs: list[dict]) -> float:
    """Same data, model and optimizer: the per-step losses must agree in every run (a
    correctness check on the comparison itself, not a performance figure). Returns the
    largest relative difference; exits 1 naming the step where they differ."""
    b0 = next(r for r in runs if r["side"] == "torchrun")
    loss_diff = 0.0
    for r in runs[1:]:
        if len(r["losses"]) != len(b0["losses"]):
            raise SystemExit(f"{r['side']} rep {r['rep']} ran {len(r['losses'])} steps, torchrun {len(b0['losses'])}")
        for step, (x, y) in enumerate(zip(b0["losses"], r["losses"]), 1):
            if abs(x - y) > LOSS_RTOL * abs(x):
                raise SystemExit(
                    f"losses differ at step {step}: torchrun {x!r}, {r['side']} rep {r['rep']} {y!r} "
                    f"(rel {abs(x - y) / abs(x):.1e} > {LOSS_RTOL:g}): not a like-for-like comparison"
                )
            loss_diff = max(loss_diff, abs(x - y) / abs(x))
    return loss_diff


def figures(runs: list[dict], tokens_per_step: int) -> dict[str, Any]:
    """Tokens/s of every run (added to it), and the ratios: per repetition, ours against the
    torchrun run of the same repetition; the headline is their median."""
    for r in runs:
        r["tokens_per_s"] = tokens_per_step / r["s_per_step"]
    by_side = {s: [r for r in runs if r["side"] == s] for s in ("torchrun", "ours", "ours-nosnap")}
    by_side = {s: rs for s, rs in by_side.items() if rs}
    base, ours = by_side["torchrun"], by_side["ours"]
    mean_tps = {s: statistics.fmean(r["tokens_per_s"] for r in rs) for s, rs in by_side.items()}
    pair_ratios = [o["tokens_per_s"] / b["tokens_per_s"] for b, o in zip(base, ours)]
    return {
        "mean_tokens_per_s": mean_tps,
        "pair_ratios": pair_ratios,
        "ratio": statistics.median(pair_ratios),
        "ratio_of_means": mean_tps["ours"] / mean_tps["torchrun"],
        "cpu_per_step_s": {s: statistics.median(r["cpu_per_step_s"] for r in rs) for s, rs in by_side.items()},
        "job_cpu_per_step_s": {s: statistics.median(r["job_cpu_per_step_s"] for r in rs) for s, rs in by_side.items()},
        "cpu_pair_ratios": [b["cpu_per_step_s"] / o["cpu_per_step_s"] for b, o in zip(base, ours)],
        "job_cpu_pair_ratios": [b["job_cpu_per_step_s"] / o["job_cpu_per_step_s"] for b, o in zip(base, ours)],
        "first_step_s": {s: statistics.median(r["first_step_s"] for r in rs) for s, rs in by_side.items()},
    }


def print_table(runs: list[dict]) -> None:
    print()
    print(
        f"{'rep':>3}  {'side':<11} {'s/step':>8} {'tokens/s':>10} {'robust':>8} {'in-step':>8} {'cpu/step':>9} "
        f"{'job cpu':>8} {'wall s':>7} {'load':>5}  final loss"
    )
    for r in runs:
        print(
            f"{r['rep']:>3}  {r['side']:<11} {r['s_per_step']:8.4f} {r['tokens_per_s']:10.0f} "
            f"{r['s_per_step_robust']:8.4f} "
            f"{r['median_step_time_s']:8.4f} {r['cpu_per_step_s']:9.4f} {r['job_cpu_per_step_s']:8.4f} "
            f"{r['wall_s']:7.1f} "
            f"{r['load']:5.1f}  {r['losses'][-1]:.4f}"
        )
    print(
        "(s/step: least-squares slope of step completion times over the steady window, the headline figure;\n"
        " robust: Theil-Sen slope of the same points; in-step: median time inside a step as the workers measure "
        "it;\n"
        " cpu/step: CPU seconds per step of one training process (mean over them); job cpu: CPU seconds per step\n"
        " of the whole process tree; load: 1-minute load average of the machine when the run ended)"
    )


def print_figures(runs: list[dict], fig: dict[str, Any], loss_diff: float) -> None:
    mean_tps, pair_ratios = fig["mean_tokens_per_s"], fig["pair_ratios"]
    print(
        "mean tokens/s: "
        + ", ".join(f"{s} {v:.0f}" for s, v in mean_tps.items())
        + f"; per-rep ratios ours/torchrun {', '.join(f'{x:.3f}' for x in pair_ratios)}"
    )
    if "ours-nosnap" in mean_tps:
        print(
            f"ratio ours-nosnap/torchrun = {mean_tps['ours-nosnap'] / mean_tps['torchrun']:.2f} "
            f"(memory snapshots off: what the per-step snapshot costs)"
        )
    short = [r for r in runs if r["side"].startswith("ours") and r["window_s"] < MIN_WINDOW_S]
    if short:
        print(
            f"warning: a steady window of ours lasted {min(r['window_s'] for r in short):.1f} s, under "
            f"{MIN_WINDOW_S:g} s: "
            f"a slope over so short a window is noisy, so such a short "
            f"window mis-measures ours; use more --steps or a larger --size"
        )
    cores = os.cpu_count() or 1
    busy = max(r["load"] for r in runs)
    if busy > cores:
        print(
            f"note: the machine was busy (1-minute load up to {busy:.1f} on {cores} cores, from other users): "
            f"the ratios of this run carry that noise"
        )
    ours = next(r for r in runs if r["side"] == "ours")
    print(
        f"losses agree: max relative difference over {len(ours['losses'])} steps and every run {loss_diff:.1e} "
        f"(asserted <= {LOSS_RTOL:g})"
    )
    cpu_pairs, job_pairs = fig["cpu_pair_ratios"], fig["job_cpu_pair_ratios"]
    print(
        f"cpu ratio torchrun/ours (training processes) = {statistics.median(cpu_pairs):.3f} "
        f"(per rep {', '.join(f'{x:.3f}' for x in cpu_pairs)}); (whole job) = {statistics.median(job_pairs):.3f} "
        f"(per rep {', '.join(f'{x:.3f}' for x in job_pairs)})"
    )
    per_rep = {s: ", ".join(f"{r['first_step_s']:.1f}" for r in runs if r["side"] == s) for s in fig["first_step_s"]}
    print(
        "time to first step (launch to step 1 done by every rank), median over reps: "
        + "; ".join(f"{s} {v:.1f} s (per rep {per_rep[s]})" for s, v in fig["first_step_s"].items())
    )
    print(
        f"ratio of mean tokens/s ours/torchrun = {fig['ratio_of_means']:.2f}; median of the per-rep paired ratios "
        "follows"
    )
    print(f"ratio ours/torchrun = {fig['ratio']:.2f} (goal >= {GOAL})")


def write_report(
    path: str, args: argparse.Namespace, spec: Any, tokens_per_step: int, runs: list[dict], fig: dict, loss_diff: float
) -> None:
    doc = {
        "date_utc": utc_stamp(),
        "host": os.uname().nodename,
        "cores": os.cpu_count(),
        "workers": args.workers,
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "size": args.size,
        "global_batch": spec.train.global_batch,
        "micro_batch": spec.parallel.micro_batch,
        "grad_accum": spec.grad_accum(args.workers),
        "tokens_per_step": tokens_per_step,
        "runs": [{k: r[k] for k in RUN_KEYS} | {"final_loss": r["losses"][-1]} for r in runs],
        "mean_tokens_per_s": fig["mean_tokens_per_s"],
        "pair_ratios": fig["pair_ratios"],
        "ratio": fig["ratio"],
        "ratio_of_means": fig["ratio_of_means"],
        "goal": GOAL,
        "ratio_definition": "median over reps of tokens/s(ours) / tokens/s(torchrun) of the same rep",
        "max_loss_rel_diff": loss_diff,
        "cpu_per_step_s": fig["cpu_per_step_s"],
        "job_cpu_per_step_s": fig["job_cpu_per_step_s"],
        "cpu_pair_ratios": fig["cpu_pair_ratios"],
        "job_cpu_pair_ratios": fig["job_cpu_pair_ratios"],
        "first_step_s": fig["first_step_s"],
        "first_step_definition": "seconds from the launch of the side's process tree to step 1 done by every rank",
    }
    write_json(path, doc)
