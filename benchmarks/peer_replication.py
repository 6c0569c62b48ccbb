"""What copying every memory snapshot to a peer costs a ZeRO-3 run, and what it buys.

Two runs of the same spec alternate on an embedded local Ray (quickstart model, ZeRO-3,
dp 2, a memory snapshot every step, no storage checkpoints): ``checkpoint.replicate=false``
(the baseline) and ``true``, where each rank's snapshot is sent to the other rank (on one
machine the peer is another process; on a cluster it is another node). Throughput is the
least-squares slope of the step events' completion times over the steady window; the
snapshot blocking time is the memory ``checkpoint`` events' ``blocking_s``. Printed::

    throughput replicate/off = X.XX   (1.00 = free)
    snapshot blocking_s median: off A ms, replicate B ms; step time C ms

Then one more replicated run loses rank 1 (SIGKILL) mid-run and must restore from peer
memory; without the copy the same failure restarts from step 0 (no storage tier here).

Usage::

    .venv/bin/python -m benchmarks.peer_replication [--steps 60] [--reps 2] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile

from benchmarks.harness import QUICKSTART
from benchmarks.harness.cluster import embedded_cpus, local_ray
from benchmarks.harness.stats import least_squares_slope
from elastic import ElasticTrainer
from elastic.faults import Fault, FaultInjector
from jobs.spec import JobSpec

WARMUP = 5


def _events(run_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["kind"] == kind]


def run(work: str, name: str, steps: int, replicate: bool, extra: list[str], callbacks=()) -> tuple[str, dict]:
    overrides = [
        f"train.steps={steps}",
        "parallel.zero=3",
        "elastic.min_dp=2",
        "elastic.max_dp=2",
        "checkpoint.every_steps=0",
        "checkpoint.memory_every_steps=1",
        f"checkpoint.replicate={str(replicate).lower()}",
        *extra,
    ]
    spec = JobSpec.from_yaml(QUICKSTART, overrides=overrides)
    run_dir = os.path.join(work, name)
    # Its own Ray, sized as the trainer's embedded one: never a cluster another process recorded.
    with local_ray(embedded_cpus(spec)):
        result = ElasticTrainer(spec, run_dir=run_dir, callbacks=list(callbacks)).fit()
    return run_dir, result.model_dump()


def measure(run_dir: str) -> dict:
    steps = {e["step"]: e["ts"] for e in _events(run_dir, "step")}
    window = [(s, t) for s, t in sorted(steps.items()) if s > WARMUP]
    blocking = [e["blocking_s"] for e in _events(run_dir, "checkpoint") if e["tier"] == "memory" and e["step"] > WARMUP]
    return {"s_per_step": least_squares_slope(window), "blocking_s": statistics.median(blocking)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="peer-replication-")
    try:
        figures: dict[bool, list[dict]] = {False: [], True: []}
        for rep in range(args.reps):
            for replicate in (False, True):
                run_dir, _ = run(work, f"rep{rep}-{'on' if replicate else 'off'}", args.steps, replicate, args.set)
                figures[replicate].append(measure(run_dir))
                m = figures[replicate][-1]
                print(
                    f"rep {rep} replicate={replicate!s:5}  {m['s_per_step'] * 1e3:7.1f} ms/step  "
                    f"snapshot blocking {m['blocking_s'] * 1e3:6.2f} ms"
                )
        off = statistics.median(m["s_per_step"] for m in figures[False])
        on = statistics.median(m["s_per_step"] for m in figures[True])
        print(f"throughput replicate/off = {off / on:.2f}   (1.00 = free)")
        print(
            f"snapshot blocking_s median: off {statistics.median(m['blocking_s'] for m in figures[False]) * 1e3:.2f} "
            "ms, "
            f"replicate {statistics.median(m['blocking_s'] for m in figures[True]) * 1e3:.2f} ms; step time "
            f"{on * 1e3:.1f} ms"
        )
        for replicate in (True, False):
            fault = FaultInjector([Fault("kill_worker", at_step=args.steps // 2, rank=1)])
            run_dir, result = run(
                work, f"fault-{'on' if replicate else 'off'}", args.steps, replicate, args.set, [fault]
            )
            restores = [(e["source"], e["step"]) for e in _events(run_dir, "restore")]
            rec = result["recoveries"][0] if result["recoveries"] else {}
            print(
                f"rank 1 killed at step {args.steps // 2}, replicate={replicate!s:5}: "
                f"restore {restores or 'none (restart from step 0)'}, "
                f"lost steps {rec.get('lost_steps')}, recovery {rec.get('recover_s')} s"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
