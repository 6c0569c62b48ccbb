"""A new rank's start on a busy host: its imports at Ray's worker niceness (15) vs at 0.

A rank spawned to replace a lost one, or to grow back into returned capacity, starts as a
Ray worker process at Ray's ``worker_niceness`` (15). Before this change it stayed there
through its imports (torch, DCP, DTensor, the engine: about 3.5 s of one core) until
``TrainWorker.__init__`` reset it, so on a host whose cores the training ranks keep busy
the imports ran behind every one of them, while a recovery or a grow-back waited
(``elastic.priority.leave_ray_worker_niceness``, which ``elastic.worker`` now calls first).

This benchmark starts actors that import the rank's module (``elastic.worker.actor``), as
``TrainWorker.__init__`` does, on a single-node Ray beside ``--busy`` nice-0 busy
processes (stand-ins for the host's training ranks: on CPU they compute; on a GPU host,
the data loaders and the host side of each rank). Two sides, alternating repetition by
repetition (A B B A ...):

- ``product``: the module as shipped (the process leaves niceness 15 before torch);
- ``baseline``: the same import with ``leave_ray_worker_niceness`` switched off in that
  process, which is the order of before (it stays at 15 until the actor's own code runs).

Timed from ``.remote()`` to the actor's first answer (``start_s``: Ray's process start and
the imports), and the imports alone inside the actor (``import_s``). Printed: median and
range per side, the ratio baseline / product, the machine's load before and after.

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


class RankImport:
    """An actor that imports the rank's module in ``__init__``; ``keep_ray_niceness``:
    the baseline (the import stays at Ray's niceness)."""

    def __init__(self, keep_ray_niceness: bool):
        self.nice_at_start = os.getpriority(os.PRIO_PROCESS, 0)
        if keep_ray_niceness:
            from elastic import priority

            priority.leave_ray_worker_niceness = lambda: None  # this process only: the order of before
        t0 = time.perf_counter()
        import elastic.worker.actor  # noqa: F401

        self.import_s = time.perf_counter() - t0
        self.nice_after = os.getpriority(os.PRIO_PROCESS, 0)

    def facts(self) -> dict[str, Any]:
        return {"import_s": self.import_s, "nice_at_start": self.nice_at_start, "nice_after": self.nice_after}


def start_once(ray: Any, side: str) -> dict[str, Any]:
    actor_cls = ray.remote(num_cpus=0, max_restarts=0)(RankImport)
    t0 = time.perf_counter()
    actor = actor_cls.remote(side == "baseline")
    facts = ray.get(actor.facts.remote(), timeout=START_TIMEOUT_S)
    facts["start_s"] = time.perf_counter() - t0
    ray.kill(actor)
    return facts


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
                facts = start_once(ray, side)
                runs[side].append(facts)
                print(
                    f"  rep {rep} {side:>8}: start {facts['start_s']:.2f} s, import {facts['import_s']:.2f} s"
                    f" (nice {facts['nice_at_start']} -> {facts['nice_after']})",
                    flush=True,
                )
            load.append(os.getloadavg()[0])
    finally:
        for p in busy:
            p.kill()
        ray.shutdown()
    summary = {s: {k: median_range(r[k] for r in runs[s]) for k in ("start_s", "import_s")} for s in SIDES}
    ratio = {
        k: round(summary["baseline"][k]["median"] / summary["product"][k]["median"], 2) for k in ("start_s", "import_s")
    }
    print(f"rank start beside {args.busy} busy nice-0 processes, {args.reps} starts per side:")
    for s in SIDES:
        st, im = summary[s]["start_s"], summary[s]["import_s"]
        print(
            f"  {s:>8}: start {st['median']:.2f} s [{st['min']:.2f}, {st['max']:.2f}],"
            f" imports {im['median']:.2f} s [{im['min']:.2f}, {im['max']:.2f}]"
        )
    print(f"  baseline / product: start {ratio['start_s']:.2f}x, imports {ratio['import_s']:.2f}x")
    print(f"load (1 min) before and after each repetition: {[round(x, 2) for x in load]}")
    if args.json:
        doc = {"busy": args.busy, "reps": args.reps, "summary": summary, "ratio_baseline_over_product": ratio}
        write_json(args.json, {**doc, "runs": runs, "load_1min": load, "date_utc": utc_stamp(), "machine": machine()})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
