"""``elastic simulate``: flags, output and figures (docs/simulate.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn

from elastic.simulator import model
from elastic.simulator.costs import CAUSES, LLAMA3_CAUSES, NODE_STAYS, Costs
from elastic.simulator.scaling import load_curve
from elastic.simulator.scaling import summary as curve_summary

STRATEGIES = ("inplace", "restart")
# Bounds past which the inputs describe no cluster and no job (docs/simulate.md): refused,
# exit 2, before anything is simulated.
MAX_DAYS = 3650.0  # ten years
MAX_FAILURE_RATE = 1000.0  # per 1,000 node-days: every node failing once a day
STEP_S = (0.001, 3600.0)  # a step of a millisecond to an hour
MIN_STEPS = 100  # the simulated time holds at least this many steps


def _int(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    return parse


def _float(lo: float, strict: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")) or value < lo or (strict and value == lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo:g}, got {text}")
        return value

    return parse


def _interval(text: str) -> float | str:
    return "auto" if text == "auto" else _float(0, strict=True)(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=_int(1), default=16384, help="GPUs of the job (default 16384)")
    p.add_argument("--gpus-per-node", type=_int(1), default=8, help="default 8")
    p.add_argument("--nodes-per-rack", type=_int(1), default=2, help="default 2 (Llama 3's racks: 2 servers)")
    p.add_argument(
        "--failure-rate", type=_float(0, False), default=6.5, help="node failures per 1,000 node-days (default 6.5)"
    )
    p.add_argument("--days", type=_float(0, True), default=30.0, help="simulated days (default 30)")
    p.add_argument("--strategy", choices=("inplace", "restart", "both"), default="both")
    p.add_argument(
        "--ckpt-interval-s",
        type=_interval,
        default="auto",
        help="storage checkpoint interval in training seconds, or auto: the one that maximises ETTR (default)",
    )
    p.add_argument("--spares", type=_int(0), default=None, help="idle spare nodes (default: 2%% of the job's nodes)")
    p.add_argument("--repair-hours", type=_float(0, False), default=24.0, help="until a failed node returns (24)")
    p.add_argument("--seed", type=_int(0), default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by strategy")
    p.add_argument("--out", default=None, help="write ettr_vs_scale.png, ettr_vs_interval.png, timeline.png here")
    p.add_argument("--tp", type=_int(1), default=8, help="tensor parallel degree (default 8)")
    p.add_argument("--pp", type=_int(1), default=16, help="pipeline stages (default 16)")
    p.add_argument(
        "--global-batch", type=_int(1), default=None, help="sequences per step (default 16 per replica at full DP)"
    )
    p.add_argument("--step-s", type=_float(0, True), default=None, help="seconds per step at full DP")
    p.add_argument("--max-failures", type=_int(0), default=None, help="failure budget (default: unlimited)")


def _bad(flag: str, message: str) -> int:
    print(f"error: {flag}: {message}", file=sys.stderr)
    return 2


def build(args: argparse.Namespace) -> tuple[model.Job, model.Scenario]:
    job = model.Job(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        nodes_per_rack=args.nodes_per_rack,
        tp=args.tp,
        pp=args.pp,
        spares=args.spares,
        global_batch=args.global_batch,
        max_failures=args.max_failures,
    )
    sc = model.Scenario(failure_rate=args.failure_rate, days=args.days, repair_hours=args.repair_hours, seed=args.seed)
    return job, sc


def _check(args: argparse.Namespace, job: model.Job) -> tuple[str, str] | None:
    if job.max_dp < 1:
        return "--gpus", f"{args.gpus} GPUs hold no whole replica of tp*pp={job.replica_gpus}"
    if job.replica_gpus % args.gpus_per_node and args.gpus_per_node % job.replica_gpus:
        return "--tp", f"a replica of tp*pp={job.replica_gpus} GPUs must fill whole {args.gpus_per_node}-GPU nodes"
    if args.tp > args.gpus_per_node:
        return "--tp", f"tp={args.tp} is larger than a node ({args.gpus_per_node} GPUs): TP stays inside NVLink"
    if job.total_nodes > 200_000:
        return "--gpus", "at most 200,000 nodes"
    if args.days > MAX_DAYS:
        return "--days", f"at most {MAX_DAYS:g} (ten years), got {args.days:g}"
    if args.failure_rate > MAX_FAILURE_RATE:
        return "--failure-rate", (
            f"at most {MAX_FAILURE_RATE:g} failures per 1,000 node-days (every node once a day), "
            f"got {args.failure_rate:g}"
        )
    if args.days * args.failure_rate / 1000 * job.total_nodes > 2_000_000:
        return "--days", "more than 2 million failures to simulate: lower --days or --failure-rate"
    if job.batch < job.max_dp:
        split = f"{job.batch} sequence(s) cannot be split over dp={job.max_dp} replicas: at least {job.max_dp}"
        return "--global-batch", split
    return _check_times(args, job)


def _check_times(args: argparse.Namespace, job: model.Job) -> tuple[str, str] | None:
    """The step (given, or what ``--global-batch`` makes it) and the checkpoint interval
    against the simulated time."""
    try:
        step = model.strategy_costs("inplace", job, args.step_s).step_s
    except FileNotFoundError:
        return None  # main() says which measured cost is missing
    flag = "--step-s" if args.step_s is not None else "--global-batch"
    made = f"{step:g} s" if args.step_s is not None else f"{job.batch} sequences make a step of {step:.3g} s"
    lo, hi = STEP_S
    if not lo <= step <= hi:
        return flag, f"{made}: a step must take {lo:g} to {hi:g} s"
    wall = args.days * model.DAY
    if wall < MIN_STEPS * step:
        return "--days", f"{args.days:g} days ({wall:g} s) hold fewer than {MIN_STEPS} steps of {step:.3g} s"
    if args.ckpt_interval_s != "auto" and args.ckpt_interval_s > wall:
        return "--ckpt-interval-s", (
            f"at most the simulated time (--days {args.days:g} = {wall:g} s), got {args.ckpt_interval_s:g}"
        )
    return None


def run_strategy(args, job, sc, strategy, events, reaction) -> tuple[model.Result, dict[str, Any], list]:
    costs = model.strategy_costs(strategy, job, args.step_s)
    curve: list = []
    if args.ckpt_interval_s == "auto":
        interval, curve = model.best_interval(job, sc, costs, strategy, events, reaction)
    else:
        interval = model.effective_interval(costs, args.ckpt_interval_s)
    res = model.simulate(job, sc, costs, strategy, interval, events, reaction)
    return res, params(args, job, sc, costs, interval, reaction, strategy), curve


def params(args, job, sc, costs: Costs, interval: float, reaction: model.Reaction, strategy: str) -> dict[str, Any]:
    weights = {c: LLAMA3_CAUSES[c][0] / sum(n for n, _ in LLAMA3_CAUSES.values()) for c in CAUSES}
    detect_mean = sum(weights[c] * costs.detect_s[c] for c in CAUSES)
    p = {
        "strategy": strategy,
        "nodes": job.job_nodes,
        "gpus": job.gpus,
        "gpus_per_node": job.gpus_per_node,
        "nodes_per_rack": job.nodes_per_rack,
        "spares": job.spare_nodes,
        "failure_rate": sc.failure_rate,
        "failure_rate_per_node_s": sc.rate_per_node_s,
        "days": sc.days,
        "repair_hours": sc.repair_hours,
        "seed": sc.seed,
        "tp": job.tp,
        "pp": job.pp,
        "dp": job.max_dp,
        "global_batch": job.batch,
        "allowed_dps": reaction.allowed,
        "ckpt_interval_s": interval,
        "ckpt_interval_auto": args.ckpt_interval_s == "auto",
        "detect_s": detect_mean,
        "detect_s_by_cause": dict(costs.detect_s),
        "cause_weights": weights,
        "causes_keep_node": sorted(NODE_STAYS),
    }
    for k, v in costs.as_params().items():
        if k not in ("detect_s", "sources"):
            p[k] = v
    p["u0_s"] = detect_mean + costs.restart_s
    p["planner_calls"] = reaction.planner_calls
    p["sources"] = dict(costs.sources)
    curve = load_curve()
    if curve is not None:  # the measured re-formation curve and what bounds it (docs/simulate.md)
        p["reform_curve"] = curve_summary(curve, job.gpus)
    return p


def dominant(result: model.Result) -> tuple[str, float]:
    items = {k: v for k, v in result.breakdown_s.items() if k != "reduced_dp"}
    name = max(items, key=items.__getitem__) if items else "none"
    return name, items.get(name, 0.0)


def main(args: argparse.Namespace) -> int:
    from elastic.errors import SpecError

    job, sc = build(args)
    problem = _check(args, job)
    if problem:
        return _bad(*problem)
    if args.out:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as exc:
            return _bad("--out", str(exc))
    try:
        reaction = model.Reaction(job)
        events = model.cluster_events(job, sc)
        strategies = STRATEGIES if args.strategy == "both" else (args.strategy,)
        out = {s: run_strategy(args, job, sc, s, events, reaction) for s in strategies}
    except SpecError as exc:
        return _bad(exc.field if hasattr(exc, "field") else "--gpus", str(exc))
    except FileNotFoundError as exc:
        print(f"error: a measured cost is missing: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {}
        for s, (res, p, _) in out.items():
            doc[s] = res.summary() | {"params": p}
        print(json.dumps(doc, indent=2))
    else:
        print(report(job, sc, out))
    if args.out:
        from elastic.simulator import figures

        paths = figures.write_all(args, job, sc, out, events, reaction)
        if not args.json:
            print("wrote " + ", ".join(paths))
    return 0


def report(job: model.Job, sc: model.Scenario, out: dict) -> str:
    lines = [
        f"{job.gpus} GPUs ({job.job_nodes} nodes + {job.spare_nodes} spares, {job.nodes_per_rack} per rack), "
        f"tp={job.tp} pp={job.pp} dp={job.max_dp}; {sc.failure_rate:g} failures per 1,000 node-days, "
        f"{sc.days:g} days, repair {sc.repair_hours:g} h, seed {sc.seed}",
        f"{'strategy':<9}{'ETTR':>8}{'goodput':>9}{'mean DP':>9}{'failures':>10}{'downtime h':>12}"
        f"{'lost h':>8}{'interval s':>12}",
    ]
    for s, (res, p, _) in out.items():
        lines.append(
            f"{s:<9}{res.ettr:>8.4f}{res.goodput:>9.4f}{res.mean_dp_fraction:>9.4f}{res.failures:>10}"
            f"{res.downtime_s / 3600:>12.2f}{res.lost_work_s / 3600:>8.2f}{p['ckpt_interval_s']:>12.0f}"
        )
    for s, (res, p, curve) in out.items():
        if p["ckpt_interval_auto"]:
            lines.append(
                f"{s}: --ckpt-interval-s auto picked {p['ckpt_interval_s']:.0f} s, the highest ETTR of "
                f"{len(curve)} intervals tried ({curve[0][0]:.0f}..{curve[-1][0]:.0f} s)"
            )
        name, secs = dominant(res)
        rest = (1 - res.ettr) * sc.days * model.DAY
        if rest < 1.0:  # under a second: no share of it means anything
            lines.append(f"{s}: nothing of the wall clock was lost")
            continue
        share = f"{secs / rest:.0%} of the {rest / 3600:.1f} h lost"
        lines.append(f"{s}: the largest cost in what is left is {name} ({share})")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"error: {message}\n")


def standalone(argv: list[str] | None = None) -> int:
    """``python -m elastic.simulator.cli``: the same flags as ``elastic simulate``."""
    p = _Parser(prog="elastic simulate", description=__doc__)
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(standalone())
