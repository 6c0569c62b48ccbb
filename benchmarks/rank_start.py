"""A new rank's start on a busy host: the rank as shipped vs its arguments opened at Ray's
worker niceness (15), the order of before.

A rank spawned to replace a lost one, or to grow back into returned capacity, starts as a
Ray worker process at Ray's ``worker_niceness`` (15). ``elastic.worker`` sets the process
back to 0 before it imports torch (``elastic.priority.leave_ray_worker_niceness``), but Ray
deserializes an actor's arguments before it loads the actor's class, and unpickling the
spec imports ``elastic.spec`` and, through the data config, torch: about 3 s of one core,
at 15, behind every nice-0 process on the host. The arguments now travel pickled
(``elastic.worker.start_args``) and are opened in ``TrainWorker.__init__``, at 0.

This benchmark starts real ranks (``Rank`` behind a Ray actor, a tiny spec) on a
single-node Ray beside ``--busy`` nice-0 busy processes (stand-ins for the host's training
ranks: on CPU they compute; on a GPU host, the data loaders and the host side of each
rank), each in a fresh worker process (its own runtime env). Two sides, alternating
repetition by repetition (A B B A ...):

- ``product``: ``TrainWorker`` as shipped, its arguments from ``start_args``;
- ``baseline``: the same shell with the spec, the corpus and the hook passed as Ray
  arguments, which is ``TrainWorker`` before this change.

Timed from ``.remote()`` to the rank's first answer (``info()``: Ray's process start, the
arguments, the imports and ``Rank.__init__``). Printed: median and range per side, the
ratio baseline / product, the machine's load before and after.

Usage::

    .venv/bin/python -m benchmarks.rank_start [--reps 3] [--busy 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.harness.results import machine, utc_stamp, write_json
from benchmarks.harness.stats import median_range

SIDES = ("product", "baseline")
START_TIMEOUT_S = 600.0  # one actor's start, at worst (the baseline at nice 15 under full load)


SPEC = {
    "name": "rank-start",
    "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
    "data": {"num_samples": 4000},
    "parallel": {"micro_batch": 2},
    "elastic": {"min_dp": 1, "max_dp": 1},
    "train": {"steps": 4, "global_batch": 2},
}


class DirectArgs:
    """``TrainWorker`` before this change: its arguments are Ray's, unpickled by Ray before
    the class is loaded (so at Ray's niceness, torch with the spec)."""

    def __init__(self, spec: Any, corpus_uri: str, step_hook: Any = None):
        from elastic.worker.actor import Rank

        self._rank = Rank(spec, corpus_uri, step_hook)

    def info(self) -> Any:
        return self._rank.info()


def start_once(ray: Any, side: str, tag: str) -> dict[str, Any]:
    from elastic.worker import TrainWorker, start_args
    from jobs import JobSpec

    spec = JobSpec.from_dict(SPEC)
    fresh = {"num_cpus": 0, "runtime_env": {"env_vars": {"ELASTIC_BENCH_RANK_START": tag}}}  # a new process
    t0 = time.perf_counter()
    if side == "product":
        actor = TrainWorker.options(**fresh).remote(start_args(spec, "memory://none"))
    else:
        actor = ray.remote(max_restarts=0)(DirectArgs).options(**fresh).remote(spec, "memory://none", None)
    info = ray.get(actor.info.remote(), timeout=START_TIMEOUT_S)
    start_s = time.perf_counter() - t0
    ray.kill(actor)
    return {"start_s": start_s, "pid": info.pid}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="starts per side")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="nice-0 busy processes beside the starts")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps: must be at least 1")
    if args.busy < 0:
        ap.error("--busy: must be >= 0")
    import ray

    if os.geteuid() != 0:
        print("note: not root: Ray's workers may not lower their niceness here (both sides then stay at 15)")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    load = [os.getloadavg()[0]]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    try:
        time.sleep(2.0)  # the busy processes at full speed before the first start
        for rep in range(args.reps):
            order = SIDES if rep % 2 == 0 else SIDES[::-1]
            for side in order:
                facts = start_once(ray, side, f"{rep}-{side}")
                runs[side].append(facts)
                print(f"  rep {rep} {side:>8}: start {facts['start_s']:.2f} s", flush=True)
            load.append(os.getloadavg()[0])
    finally:
        for p in busy:
            p.kill()
        ray.shutdown()
    summary = {s: {"start_s": median_range(r["start_s"] for r in runs[s])} for s in SIDES}
    ratio = {"start_s": round(summary["baseline"]["start_s"]["median"] / summary["product"]["start_s"]["median"], 2)}
    print(f"rank start beside {args.busy} busy nice-0 processes, {args.reps} starts per side:")
    for s in SIDES:
        st = summary[s]["start_s"]
        print(f"  {s:>8}: start {st['median']:.2f} s [{st['min']:.2f}, {st['max']:.2f}]")
    print(f"  baseline / product: start {ratio['start_s']:.2f}x")
    print(f"load (1 min) before and after each repetition: {[round(x, 2) for x in load]}")
    if args.json:
        doc = {"busy": args.busy, "reps": args.reps, "summary": summary, "ratio_baseline_over_product": ratio}
        write_json(args.json, {**doc, "runs": runs, "load_1min": load, "date_utc": utc_stamp(), "machine": machine()})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
