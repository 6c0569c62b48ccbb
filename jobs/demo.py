"""``elastic demo`` / ``make demo``: the quickstart job, a node failure, and the recovery.

It starts an embedded multi-node Ray on this machine (``ray.cluster_utils.Cluster``: a
head plus one single-worker node per DP replica), trains ``examples/quickstart.yaml``,
kills one node mid-run with real signals (SIGKILL its worker, then remove the node), lets
the elastic controller shrink DP and carry on, brings a node back, and lets DP grow back.
It ends with the recovery figures.
"""

from __future__ import annotations

import logging
import os
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "quickstart.yaml")
KILL_AT_STEP = 30
RETURN_AFTER_S = 8.0


def run_demo(run_dir: str | None = None, inject_fault: bool = True) -> int:
    import ray
    from ray.cluster_utils import Cluster

    from elastic.api import ElasticTrainer
    from elastic.faults import Fault, FaultInjector
    from jobs.spec import JobSpec

    spec = JobSpec.from_yaml(EXAMPLE)
    if not inject_fault:
        result = ElasticTrainer(spec, run_dir=run_dir, progress=True, report=True).fit()
        return 0 if result.status == "succeeded" else 1

    logging.getLogger("ray").setLevel(logging.ERROR)
    nodes = spec.elastic.max_dp
    print(f"starting an embedded Ray cluster: 1 head + {nodes} worker nodes (1 CPU each)", flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    node_args = {"num_cpus": int(spec.resources.cpus_per_worker)}
    for _ in range(nodes):
        cluster.add_node(**node_args)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
    injector = FaultInjector(
        [
            Fault(
                "kill_node",
                at_step=KILL_AT_STEP,
                node_index=nodes - 1,
                return_after_s=RETURN_AFTER_S,
                graceful_raylet=True,
            )
        ],
        cluster=cluster,
        node_args=node_args,
    )
    print(f"plan: kill a worker node after step {KILL_AT_STEP}, bring one back {RETURN_AFTER_S:g}s later\n", flush=True)
    try:
        trainer = ElasticTrainer(spec, run_dir=run_dir, callbacks=[injector], progress=True, report=True)
        result = trainer.fit()
    finally:
        ray.shutdown()
        cluster.shutdown()
    _explain(result)
    return 0 if result.status == "succeeded" else 1


RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results", "recovery.json"
)


def _explain(result) -> None:
    dps = " -> ".join(str(dp) for _, dp in result.dp_history)
    print(f"\nDP over the run: {dps} (global batch kept exact by changing gradient accumulation)")
    for r in result.recoveries:
        print(
            f"the {r.cause} failure: training was down {r.downtime_s:.2f}s (downtime_s: from the last time the driver "
            f"heard from the lost worker to the first completed step at the smaller size); detected after "
            f"{r.detect_s:.2f}s (detect_s), then {r.recover_s:.2f}s to that step (recover_s); {r.lost_steps} step(s) "
            f"of work lost (lost_steps)"
        )
        if r.breakdown:
            print("  where the downtime went: " + ", ".join(f"{k} {v:.3f}s" for k, v in r.breakdown.items()))
    line = benchmark_comparison(RESULTS)
    if line:
        print(line)


def benchmark_comparison(path: str) -> str | None:
    """What ``benchmarks/recovery_vs_raytrain.py`` measured, quoted from its results file
    with the file's name and date; None when there is no such file (or it is unreadable).
    Nothing here is a figure this run measured, and it says so."""
    import json

    try:
        with open(path) as f:
            data = json.load(f)
        summary, date = data["summary"], data["date_utc"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    names = {
        "ours": "this runtime",
        "raytrain_tuned": "Ray Train V2 (tuned)",
        "raytrain_default": "Ray Train V2 (defaults)",
        "torchft": "TorchFT",
        "raytrain_torchft": "Ray Train V2 + TorchFT",
    }
    parts = []
    for side, name in names.items():
        s = summary.get(side) or {}
        rec, lost = s.get("recovery_s"), s.get("lost_steps")
        if rec and lost:
            parts.append(
                f"{name} {rec['median']:.2f} s (range {rec['min']:.2f}-{rec['max']:.2f}) and {lost['median']:g} "
                f"step(s) lost (n={rec['n']})"
            )
    if not parts:
        return None
    rel = os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return (
        f"for comparison, not measured by this run: {rel} (measured {date}; medians; from the kill to the first step "
        f"at the smaller size): " + "; ".join(parts)
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo())
