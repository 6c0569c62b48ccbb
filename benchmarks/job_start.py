"""A job's start, and what a node agent pays for holding its ranks' handles: the rank's Ray
actor as shipped (``elastic/worker/remote.py``, a shell that names nothing heavy) vs the
rank's class itself as the Ray actor (the shape before, whose methods name torch).

Ray loads an actor's class in every process that deserializes one of its handles, by value,
importing the modules its methods name. A node agent is handed its ranks' handles with
``Attach``, so with the old shape every agent imported torch before its first command
could be applied, and the job's first configure waited for that.

Two measurements, each with the two sides alternating repetition by repetition (A B B A):

- ``handle``: a fresh process (its own runtime env, so never a pooled worker that already
  imported torch) takes one handle of a started rank in a call's argument: the call's time,
  the growth of its resident memory, and whether torch was imported;
- ``fit``: ``ElasticTrainer.fit()`` of the tiny spec at dp 4 on a single-node Ray, from the
  call to the ``job_start`` event (the ranks started and configured) and to the first step.
  The baseline side swaps the group's actor class for the old shape in this driver
  (``elastic.control.worker_group.group.TrainWorker``); everything else is the product.

Printed: median and range per side, the ratio baseline / product, the load before and after.

Usage::

    .venv/bin/python -m benchmarks.job_start [--reps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

from benchmarks.harness.results import machine, utc_stamp, write_json
from benchmarks.harness.stats import median_range

SIDES = ("product", "baseline")
TIMEOUT_S = 300.0
SPEC = {
    "name": "job-start",
    "seed": 0,
    "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
    "data": {"num_samples": 4000},
    "parallel": {"micro_batch": 2},
    "elastic": {"min_dp": 4, "max_dp": 4, "heartbeat_timeout_s": 10, "collective_timeout_s": 20},
    "train": {"steps": 4, "global_batch": 8, "lr": 3.0e-3},
    "checkpoint": {"every_steps": 0},
}


class Holder:
    """Takes handles, as a node agent does. Ray deserializes a call's arguments before the
    method runs, so the cost is the call's time (``call_s``) and the resident memory from
    before the call (``rss``) to its end (``take``)."""

    def rss(self) -> float:
        return _rss_mb()

    def take(self, handles: list[Any]) -> dict[str, Any]:
        import sys

        assert all(hasattr(h, "reconfigure") for h in handles)  # a real handle, its methods known
        return {"rss_after_mb": _rss_mb(), "torch": "torch" in sys.modules}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kb / 1024


def old_shape(ray: Any) -> Any:
    """The rank's class itself as the Ray actor: the shape of ``TrainWorker`` before the shell
    (taking its arguments as the shell does, ``start_args``)."""
    from ray import cloudpickle

    from elastic.worker.actor import Rank
    from elastic.worker.remote import CONCURRENCY_GROUPS

    class OldShape(Rank):
        def __init__(self, args: bytes):
            super().__init__(*cloudpickle.loads(args))

    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS, max_restarts=0)(OldShape)


def handle_once(ray: Any, actor_cls: Any, tag: str) -> dict[str, Any]:
    from elastic.worker import start_args
    from jobs import JobSpec

    rank = actor_cls.options(num_cpus=0).remote(start_args(JobSpec.from_dict(SPEC), "memory://none"))
    ray.get(rank.info.remote(), timeout=TIMEOUT_S)  # started: its own imports are not in the holder's time
    holder = ray.remote(num_cpus=0)(Holder).options(runtime_env={"env_vars": {"ELASTIC_BENCH_HOLDER": tag}}).remote()
    try:
        rss0 = ray.get(holder.rss.remote(), timeout=TIMEOUT_S)
        # The handle travels inside the argument (as in ``Attach``): deserialized in the holder.
        t0 = time.perf_counter()
        facts = ray.get(holder.take.remote([rank]), timeout=TIMEOUT_S)
        facts["call_s"] = time.perf_counter() - t0
        facts["rss_mb"] = facts.pop("rss_after_mb") - rss0
        return facts
    finally:
        ray.kill(holder)
        ray.kill(rank)


def fit_once(actor_cls: Any) -> dict[str, Any]:
    import elastic.control.worker_group.group as wg
    from elastic.api import ElasticTrainer
    from jobs import JobSpec

    shipped, wg.TrainWorker = wg.TrainWorker, actor_cls
    run_dir = tempfile.mkdtemp(prefix="bench-job-start-")
    try:
        t0 = time.time()
        ElasticTrainer(JobSpec.from_dict(SPEC), run_dir=run_dir, progress=False).fit()
    finally:
        wg.TrainWorker = shipped
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    start = next(e["ts"] for e in events if e["kind"] == "job_start")
    first = next(e["ts"] for e in events if e["kind"] == "step")
    return {"to_job_start_s": start - t0, "to_first_step_s": first - t0}


def _show(name: str, runs: dict[str, list[dict[str, Any]]], keys: tuple[str, ...]) -> dict[str, Any]:
    summary = {s: {k: median_range(r[k] for r in runs[s]) for k in keys} for s in SIDES}
    ratio = {k: round(summary["baseline"][k]["median"] / max(summary["product"][k]["median"], 1e-9), 2) for k in keys}
    print(f"{name}:")
    for s in SIDES:
        parts = [f"{k} {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]" for k, v in summary[s].items()]
        print(f"  {s:>8}: " + ", ".join(parts))
    print("  baseline / product: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    return {"summary": summary, "ratio_baseline_over_product": ratio}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions per side of each measurement")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps: must be at least 1")
    import ray

    from elastic.worker.remote import TrainWorker

    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    classes = {"product": TrainWorker, "baseline": old_shape(ray)}
    load = [os.getloadavg()[0]]
    handle: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    fit: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    try:
        for rep in range(args.reps):
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                h = handle_once(ray, classes[side], f"{side}-{rep}")
                handle[side].append(h)
                f = fit_once(classes[side])
                fit[side].append(f)
                print(
                    f"  rep {rep} {side:>8}: handle {h['call_s']:.3f} s (+{h['rss_mb']:.0f} MB, torch {h['torch']}),"
                    f" fit -> job_start {f['to_job_start_s']:.2f} s, -> first step {f['to_first_step_s']:.2f} s",
                    flush=True,
                )
            load.append(os.getloadavg()[0])
    finally:
        ray.shutdown()
    print(f"{args.reps} repetitions per side, 4 ranks on {os.cpu_count()} cores:")
    doc = {
        "handle": _show("a fresh process takes a rank's handle", handle, ("call_s", "rss_mb")),
        "fit": _show("fit() of a dp 4 job", fit, ("to_job_start_s", "to_first_step_s")),
    }
    print(f"load (1 min) before and after each repetition: {[round(x, 2) for x in load]}")
    if args.json:
        runs = {"handle": handle, "fit": fit}
        write_json(
            args.json,
            {**doc, "reps": args.reps, "runs": runs, "load_1min": load, "date_utc": utc_stamp(), "machine": machine()},
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
