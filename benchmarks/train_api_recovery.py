"""A Ray Train user's own loop through a node loss: Ray Train V2 against ``elastic.train``,
the same script on both, side by side, repeated (issue 46's goals).

One user script (``benchmarks/recovery/train_api_script.py``): a small MLP under DDP
(``prepare_model``), AdamW, a map-style ``Dataset`` of ``--rows`` synthetic regression rows
that carry their row id, through ``prepare_data_loader`` (each rank's batch ``--global-batch``
over the world size), ``report`` every step, a checkpoint every ``--checkpoint-every`` steps,
a resume from ``get_checkpoint()``; every rank appends the row ids of each step to a ledger.
It runs with ``ray.train`` or ``elastic.train``, nothing else changed. Sides
(``benchmarks/recovery/train_api_side.py``):

- ``raytrain``: Ray Train V2 ``TorchTrainer``, ``ScalingConfig(num_workers=(1, 4))``
  (elastic), ``FailureConfig(max_failures=3)``, tuned as an expert would:
  ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=5``, ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2``;
  ``raytrain_dataset``: the same with a Ray Dataset (``get_dataset_shard`` +
  ``iter_torch_batches``);
- ``ours``: ``elastic.train.torch.TorchTrainer``, the same loop (it only reports checkpoints);
  ``ours_prepared``: the loop also calls ``prepare_optimizer``; ``ours_dataset``: a Ray
  Dataset. Where ``elastic.train.torch`` does not import, these are reported skipped, with
  the reason.

Each run is a fresh ``ray.cluster_utils.Cluster`` in its own child process (private
``TMPDIR``): a head with ``num_cpus=0``, 4 worker nodes with ``num_cpus=1``, Ray health
checks every 0.5 s with 3 misses. When step ``--kill-step`` is in the ledgers, the node that
hosts rank ``--kill-rank`` is killed (SIGKILL of its raylet's children, then
``remove_node``: ``benchmarks/harness/kill.py``). Figures per run, from the ledgers
(``benchmarks/recovery/train_api_ledger.py`` defines each): ``recovery_s`` (kill -> first
step completed by every rank at the smaller size), ``steps_trained_again``, and the rows of
the epoch trained once, twice and never, counted on the run's lineage (a step trained again
replaces the earlier one). The sides run interleaved, ``--repeats`` times; medians and
ranges, the ratio ours/Ray Train of the recovery medians, and the machine's load are
printed; ``--json`` prints all of it as one JSON line last, ``--results PATH`` writes it.
Usage::

    .venv/bin/python -m benchmarks.train_api_recovery [--repeats 3] [--sides raytrain,ours] [--json]

``--kills 3`` kills a node of the smaller group every ``--kill-gap`` steps after the first
(4 -> 3 -> 2 -> 1): each kill's figures are in ``recoveries``, and the resident memory of
the processes that trained after every kill (ours keeps the survivors; Ray Train starts new
workers, so it has none), at their last step before the next kill, gives
``survivor_rss_growth``: after the last re-entry over after the first, less 1 (issue 46's
goal: within 5 %). The other figures are the first kill's; the row counts are the epoch's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from benchmarks.harness.cluster import private_tmpdir
from benchmarks.harness.options import add_choice_list, chosen
from benchmarks.harness.proc import child_env, module_command, run_logged, tail, work_dir
from benchmarks.harness.results import machine, package_version, utc_stamp, write_json
from benchmarks.harness.stats import fmt, fmt_summary, summary
from benchmarks.recovery.scenario import NODES, RAY_TUNED_ENV, RAY_TUNED_SYSTEM_CONFIG
from benchmarks.recovery.train_api_side import BASELINE, SIDES

ENTRY = "benchmarks.train_api_recovery"
FIGURES = (
    "recovery_s",
    "steps_trained_again",
    "rows_once",
    "rows_twice",
    "rows_never",
    "rows_more",
    "survivor_rss_growth",
)
RECOVERY_GOAL_S = 3.0
RECOVERY_GOAL_RATIO = 0.1
MEMORY_GOAL_GROWTH = 0.05  # a survivor's RSS after 3 re-entries over after the first, less 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="A Ray Train user's loop through a node loss: Ray Train V2 vs elastic.train."
    )
    add_choice_list(ap, "sides", tuple(SIDES))
    ap.add_argument("--repeats", type=int, default=3, help="runs per side, interleaved (default 3)")
    ap.add_argument("--rows", type=int, default=1920, help="rows of the epoch (default 1920)")
    ap.add_argument("--global-batch", type=int, default=48, help="rows per step over all ranks (default 48)")
    ap.add_argument("--kill-step", type=int, default=12, help="kill the node when this step is done (default 12)")
    ap.add_argument("--kill-rank", type=int, default=1, help="kill the node hosting this rank (default 1)")
    ap.add_argument(
        "--kills",
        type=int,
        default=1,
        help="nodes killed one after another, each --kill-gap steps after the last (3: a survivor's memory "
        "after 3 re-entries) (default 1)",
    )
    ap.add_argument("--kill-gap", type=int, default=8, help="steps between kills (default 8)")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (default 5)")
    ap.add_argument(
        "--step-sleep-s",
        type=float,
        default=0.1,
        help="seconds each step sleeps after its optimizer step, a real step's compute (default 0.1)",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take (default 300)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    ap.add_argument("--results", default="", help="also write the results to this JSON file")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (ledgers, logs)")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    return ap


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The sides to run; exits 2 naming the option at fault."""
    sides = chosen(ap, args.sides, tuple(SIDES), "sides")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.global_batch < 1 or any(args.global_batch % w for w in range(1, NODES + 1)):
        ap.error(f"--global-batch must be divisible by every world size from 1 to {NODES}")
    if args.rows < args.global_batch or args.rows % args.global_batch:
        ap.error("--rows must be a positive multiple of --global-batch")
    steps = args.rows // args.global_batch
    if not 1 <= args.kills < NODES:
        ap.error(f"--kills must be in 1..{NODES - 1}")
    if args.kill_gap < 1:
        ap.error("--kill-gap must be >= 1")
    last_kill = args.kill_step + (args.kills - 1) * args.kill_gap
    if args.kill_step < 1 or last_kill >= steps:
        ap.error(
            f"--kill-step (+ --kill-gap per further kill) must be between 1 and {steps - 1} "
            "(the epoch's steps less one)"
        )
    if not 0 <= args.kill_rank < NODES - args.kills + 1:
        ap.error(f"--kill-rank must be in 0..{NODES - args.kills} (a rank of the group the last kill finds)")
    if args.checkpoint_every < 1:
        ap.error("--checkpoint-every must be >= 1")
    if args.step_sleep_s < 0:
        ap.error("--step-sleep-s must be >= 0")
    if args.timeout <= 0:
        ap.error("--timeout must be > 0")
    return sides


def run_side(side: str, rep: int, args: argparse.Namespace, work: str) -> dict[str, Any]:
    """One run of ``side`` in a child process on a fresh cluster; its result."""
    side_dir = os.path.join(work, f"{side}-{rep}")
    os.makedirs(side_dir, exist_ok=True)
    cfg = {
        "side": side,
        "work": side_dir,
        "out": os.path.join(side_dir, "result.json"),
        "rows": args.rows,
        "global_batch": args.global_batch,
        "kill_step": args.kill_step,
        "kill_rank": args.kill_rank,
        "kills": args.kills,
        "kill_gap": args.kill_gap,
        "checkpoint_every": args.checkpoint_every,
        "step_sleep_s": args.step_sleep_s,
        "side_timeout": args.timeout,
    }
    cfg_path = os.path.join(side_dir, "cfg.json")
    write_json(cfg_path, cfg)
    tmp = private_tmpdir()
    env = child_env(private_tmp=tmp)
    env["RAY_TRAIN_V2_ENABLED"] = "1"
    env.update(RAY_TUNED_ENV)
    log_path = os.path.join(side_dir, "log.txt")
    try:  # the child's own deadline fires first; this limit catches a child whose deadline failed
        rc, wall, _ = run_logged(module_command(ENTRY, "--_child", cfg_path), args.timeout + 30, env, log_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res: dict[str, Any] = {"side": side, "status": "crashed"}
    if os.path.exists(cfg["out"]):
        with open(cfg["out"]) as f:
            res = json.load(f)
    res.update(rc=rc, wall_s=wall, rep=rep, loadavg_1m_after=os.getloadavg()[0])
    if res.get("status") != "skipped" and "recovery_s" not in res:
        res["log_tail"] = tail(log_path, 30)
    return res


def print_run(r: dict[str, Any]) -> None:
    if r.get("status") == "skipped":
        print(f"  {r['side']}: skipped ({r.get('error')})", flush=True)
        return
    print(
        f"  {r['side']}: {r.get('status')}, recovery {fmt(r.get('recovery_s'))} s "
        f"(world {r.get('old_size')} -> {r.get('new_size')}), steps trained again "
        f"{fmt(r.get('steps_trained_again'), 'd')}, rows once/twice/never {fmt(r.get('rows_once'), 'd')}/"
        f"{fmt(r.get('rows_twice'), 'd')}/{fmt(r.get('rows_never'), 'd')}, wall {r['wall_s']:.0f} s, "
        f"load {r['loadavg_1m_after']:.2f}" + (f"; error: {r['error'][:300]}" if r.get("error") else ""),
        flush=True,
    )
    if len(r.get("recoveries", [])) > 1:
        each = ", ".join(
            f"{k.get('old_size')} -> {k.get('new_size')} in {fmt(k.get('recovery_s'))} s "
            f"({fmt(k.get('steps_trained_again'), 'd')} again)"
            for k in r["recoveries"]
        )
        print(f"    every kill: {each}; survivor RSS growth {fmt(r.get('survivor_rss_growth'), '.3f')}", flush=True)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of each figure over the runs that measured it; how the runs ended."""
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[r.get("status", "?")] = statuses.get(r.get("status", "?"), 0) + 1
    out: dict[str, Any] = {"statuses": statuses}
    if all(r.get("status") == "skipped" for r in runs):
        out["skipped"] = runs[0].get("error")
    for key in FIGURES:
        out[key] = summary(r.get(key) for r in runs)
    return out


def ratios_and_goals(summ: dict[str, dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any]]:
    """Ours over Ray Train (recovery medians), and each of issue 46's goals: met, not met, or not measured (None)."""
    ratios: dict[str, float] = {}
    goals: dict[str, Any] = {}

    def median(side: str, key: str) -> float | None:
        s = summ.get(side, {}).get(key)
        return None if s is None else s["median"]

    for ours, theirs in BASELINE.items():
        if ours not in summ:
            continue
        mine, base = median(ours, "recovery_s"), median(theirs, "recovery_s")
        if mine is not None and base:
            ratios[f"{ours}/{theirs}"] = mine / base
        goals[f"{ours}: recovery <= {RECOVERY_GOAL_S:g} s"] = None if mine is None else mine <= RECOVERY_GOAL_S
        ratio = ratios.get(f"{ours}/{theirs}")
        goals[f"{ours}: recovery <= {RECOVERY_GOAL_RATIO:g} x {theirs}"] = (
            None if ratio is None else ratio <= RECOVERY_GOAL_RATIO
        )
        again, base_again = median(ours, "steps_trained_again"), median(theirs, "steps_trained_again")
        if ours == "ours_prepared":
            goals[f"{ours}: 0 steps trained again"] = None if again is None else again == 0
        else:
            goals[f"{ours}: steps trained again <= {theirs}'s"] = (
                None if again is None or base_again is None else again <= base_again
            )
        runs = summ[ours].get("rows_once")
        exact = runs is not None and all(
            summ[ours][k] is not None and summ[ours][k]["max"] == 0 for k in ("rows_twice", "rows_never", "rows_more")
        )
        goals[f"{ours}: every row trained exactly once"] = None if runs is None else exact
        growth = summ[ours].get("survivor_rss_growth")
        goals[f"{ours}: survivor RSS after the last re-entry within {MEMORY_GOAL_GROWTH:.0%} of after the first"] = (
            None if growth is None else growth["max"] <= MEMORY_GOAL_GROWTH
        )
    return ratios, goals


def print_summary(sides: list[str], summ: dict[str, dict[str, Any]], ratios: dict[str, float], goals: dict) -> None:
    print("\nmedian (range) over the runs that measured it:")
    for side in sides:
        s = summ[side]
        if "skipped" in s:
            print(f"  {side}: skipped ({s['skipped']})")
            continue
        print(f"  {side}: runs {s['statuses']}; recovery {fmt_summary(s['recovery_s'])}")
        for key in FIGURES[1:-1]:
            print(f"      {key}: {fmt_summary(s[key], unit='rows' if key.startswith('rows') else 'steps', spec='.0f')}")
        if s["survivor_rss_growth"] is not None:
            print(
                "      survivor RSS growth over the re-entries: "
                + fmt_summary(s["survivor_rss_growth"], unit="", spec=".3f")
            )
    for name, value in ratios.items():
        print(f"ratio {name} (recovery medians): {value:.3f}")
    for name, met in goals.items():
        print(f"goal {name}: {'not measured' if met is None else 'met' if met else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args._child:
        from benchmarks.recovery.train_api_side import side_child

        with open(args._child) as f:
            side_child(json.load(f))
        return 0
    sides = check(ap, args)
    load_before = list(os.getloadavg())
    steps = args.rows // args.global_batch
    print(
        f"{NODES}-node local cluster (head num_cpus=0, {NODES} x num_cpus=1), an MLP under DDP, {args.rows} rows "
        f"in {steps} steps of {args.global_batch}, a checkpoint every {args.checkpoint_every} steps; the node of "
        f"rank {args.kill_rank} killed when step {args.kill_step} is done"
        + (f", then {args.kills - 1} more, one every {args.kill_gap} steps" if args.kills > 1 else "")
        + f"; {args.repeats} run(s) per side of "
        f"{', '.join(sides)}; load average {load_before[0]:.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    with work_dir("bench-train-api-", args.keep) as work:
        for rep in range(args.repeats):  # interleaved, so drifting load hits every side alike
            for side in sides:
                if runs[side] and runs[side][0].get("status") == "skipped":
                    runs[side].append(dict(runs[side][0], rep=rep))
                    continue
                print(f"[run {rep + 1}/{args.repeats}] {side} ...", flush=True)
                r = run_side(side, rep, args, work)
                runs[side].append(r)
                print_run(r)
    summ = {s: summarise(runs[s]) for s in sides}
    ratios, goals = ratios_and_goals(summ)
    print_summary(sides, summ, ratios, goals)
    load_after = list(os.getloadavg())
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} CPUs")
    doc = {
        "benchmark": "train_api_recovery",
        "date_utc": utc_stamp(),
        "machine": {**machine(), "loadavg_before": load_before},
        "versions": {p: package_version(p) for p in ("ray", "torch")},
        "settings": {k: v for k, v in vars(args).items() if k not in ("_child", "json", "results", "keep")},
        "ray_train_tuning": {"env": RAY_TUNED_ENV, "system_config": RAY_TUNED_SYSTEM_CONFIG},
        "summary": summ,
        "ratios": ratios,
        "goals": {k: v for k, v in goals.items()},
        "runs": runs,
    }
    if args.results:
        write_json(args.results, doc)
        print(f"wrote {args.results}")
    if args.json:
        print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
