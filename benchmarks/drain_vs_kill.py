"""Training gap of an announced node loss (a Ray drain) against an unannounced one (a kill).

Both runs are the same job on a fresh local 4-node Ray cluster (a CPU-less head plus four
one-CPU nodes, ``ray.cluster_utils.Cluster``): the elastic tests' tiny GPT at dp 4, every
rank held ``--step-s`` before each step so that a step lasts about that long. After step
``--at`` completes, the driver either

* **drain**: asks Ray to drain node 3 with a 30 s deadline (``GcsClient.drain_node``, the
  API of ``ray drain-node`` and autoscaler v2): the job shrinks at the next step boundary,
  state from memory, no failure; or
* **kill**: SIGKILLs node 3's worker processes and removes the node (the fault path,
  ``--fault kill_node``): detection, recovery from the survivors' snapshots, redone steps.

The training gap is the time between the last step completed before the event and the next
completed step (the step events' times), next to the ordinary gap between two steps.
Repeated ``--repeats`` times each, interleaved; prints median and range and the ratio
kill / drain, and writes ``benchmarks/results/drain_vs_kill.json`` (``--out``).

Usage: ``.venv/bin/python -m benchmarks.drain_vs_kill [--repeats 3] [--step-s 0.15] [--at 8]``
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile

from benchmarks.harness.cluster import local_cluster
from benchmarks.harness.results import results_path, utc_stamp, write_json
from benchmarks.harness.stats import median_ratio


def _spec(steps: int):
    from jobs import JobSpec

    return JobSpec.from_dict(
        {
            "name": "drain-vs-kill",
            "seed": 1,
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
            "data": {"num_samples": 4000},
            "parallel": {"micro_batch": 1},
            "elastic": {"min_dp": 1, "max_dp": 4, "heartbeat_timeout_s": 4, "collective_timeout_s": 6,
                        "min_dp_wait_s": 20},
            "train": {"steps": steps, "global_batch": 12, "lr": 3.0e-3},
            "checkpoint": {"every_steps": 0, "memory_every_steps": 1},
        }
    )  # fmt: skip


def one_run(mode: str, args: argparse.Namespace) -> dict:
    from elastic import ElasticTrainer
    from elastic.events import read_events
    from elastic.faults import Fault, FaultInjector, WorkerFaults, worker_fault

    with local_cluster(4, dashboard=False, log_level=logging.ERROR) as cluster:
        fault = Fault("drain", at_step=args.at, node_index=3, deadline_s=30.0)
        if mode == "kill":
            fault = Fault("kill_node", at_step=args.at, node_index=3, graceful_raylet=True)
        injector = FaultInjector([fault], cluster=cluster, node_args={"num_cpus": 1})
        hook = WorkerFaults([worker_fault("slow", step=1, rank=r, seconds=args.step_s) for r in range(4)])
        run_dir = tempfile.mkdtemp(prefix=f"drain-vs-kill-{mode}-")
        result = ElasticTrainer(_spec(args.steps), run_dir=run_dir, callbacks=[injector], step_hook=hook).fit()
        events = read_events(run_dir)
    steps = [e for e in events if e["kind"] == "step"]
    ts = [e["ts"] for e in steps]
    fired = fault.fired_at
    before = max(i for i, t in enumerate(ts) if t <= fired)
    after = next(i for i, e in enumerate(steps) if i > before and e["dp"] != 4)  # first step at the new size
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    ordinary = statistics.median(gaps[: before - 1]) if before > 2 else statistics.median(gaps)
    resize = next(e for e in events if e["kind"] == "resize")
    lost = resize.get("lost_steps")
    if lost is None:
        lost = sum(r.lost_steps for r in result.recoveries)
    return {
        "mode": mode,
        "status": result.status,
        "gap_s": ts[after] - ts[before],
        "ordinary_step_gap_s": ordinary,
        "failures": sum(1 for e in events if e["kind"] == "failure"),
        "lost_steps": lost,
        "reform_s": resize.get("reform_s"),
    }


def _with_retry(mode: str, args: argparse.Namespace, tries: int = 3) -> dict:
    """A run again when the local cluster itself fails to start (a loaded machine's raylet
    or GCS start timing out); a run that started is never retried."""
    for attempt in range(tries):
        try:
            return one_run(mode, args)
        except Exception as exc:  # noqa: BLE001 - only cluster start-up fails before the run
            if "timed out during startup" not in str(exc) or attempt == tries - 1:
                raise
            print(f"cluster start-up timed out ({exc}); starting it again", flush=True)
    raise AssertionError("unreachable")


def summarize(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}s (range {min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-s", type=float, default=0.15)
    p.add_argument("--at", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=results_path("drain_vs_kill.json"), help="results JSON (default %(default)s)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    runs = []
    for i in range(args.repeats):
        for mode in ("drain", "kill"):
            r = _with_retry(mode, args)
            runs.append(r)
            print(
                f"[{i + 1}/{args.repeats}] {mode:5s}: gap {r['gap_s']:.2f}s "
                f"(ordinary step {r['ordinary_step_gap_s']:.2f}s), "
                f"failures {r['failures']}, lost steps {r['lost_steps']}, {r['status']}",
                flush=True,
            )
    drain = [r["gap_s"] for r in runs if r["mode"] == "drain"]
    kill = [r["gap_s"] for r in runs if r["mode"] == "kill"]
    ordinary = [r["ordinary_step_gap_s"] for r in runs]
    print(f"training gap, drain (30 s notice): {summarize(drain)}")
    print(f"training gap, kill (no notice):    {summarize(kill)}")
    print(f"ordinary step gap:                 {summarize(ordinary)}")
    print(f"kill / drain gap ratio: {median_ratio(kill, drain):.2f}x (medians)")
    # The published file's keys, as before ``--out`` existed (``args`` records the settings).
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    doc = {
        "measured_at": utc_stamp(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(),
        "args": settings,
        "runs": runs,
    }
    write_json(args.out, doc, newline=False)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
