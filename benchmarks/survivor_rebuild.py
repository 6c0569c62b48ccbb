"""A survivor's own work in a re-formation, by state size: its engine rebuilt around the
state it kept, and that state taken back, in one process, with nothing else on the host.

``recovery_scaling`` times whole recoveries on a 4-node cluster on this machine's 2 cores:
there, the lost rank's and its dropped partner's processes give their memory back, Ray
tears the lost node down, and the other survivors rebuild at the same time, all on the
same cores, and all of it more the larger the state. Its HSDP ratio (0.5 GB vs 50 MB) has
ranged from 1.3x to 2.0x between runs of the same code. This benchmark takes the survivor's
part alone: the code the worker runs (``TrainEngine(restoring=True, adopt=...)`` and
``load_live_into``) on rank 0 of torch's fake process group (``init_process_group("fake")``:
every collective is a no-op, so only this rank's own work is timed), with
``recovery_scaling``'s models:

- ``50mb``: 4 blocks, d_model 256 (50.5 MB of parameters and AdamW state);
- ``500mb_4l``: 4 blocks, d_model 864 (0.52 GB): the same depth, 10x the bytes;
- ``500mb``: 8 blocks, d_model 640 (0.54 GB): ``recovery_scaling``'s 0.5 GB model.

Layouts, as after ``recovery_scaling``'s node loss: ``hsdp`` (zero 3, shard groups of 2):
from dp 4 to dp 2, the surviving shard group keeps its shards; ``ddp`` (zero 0): from dp 4
to dp 3, the module kept whole. Each repetition builds the engine of the old layout (not
timed), gives it an optimizer state, releases it as a failure does, then times the
survivor's rebuild (``rebuild_s``) and taking its state back (``restore_s``), wall and CPU.
Models and layouts alternate repetition by repetition. Printed: median and range, and the
ratio of each 0.5 GB model's cost to the 50 MB one's, per layout.

Usage::

    .venv/bin/python -m benchmarks.survivor_rebuild [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

from benchmarks.harness.options import add_choice_list, chosen
from benchmarks.harness.results import machine, utc_stamp
from benchmarks.harness.stats import median_range
from benchmarks.recovery_scaling import spec_dict

MODELS = ("50mb", "500mb_4l", "500mb")
# layout: (dp before, dp after); the model, zero and shard group are recovery_scaling's scenario's
LAYOUTS = {"hsdp": (4, 2), "ddp": (4, 3)}
TIMED = ("rebuild_s", "restore_s", "total_s", "cpu_s")


def _group(world: int) -> Any:
    """Rank 0 of a fresh fake process group of ``world`` ranks, and its ``ParallelDims``'s mesh."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from elastic.worker.process_group import _drop_torch_group_references

    if dist.is_initialized():
        _drop_torch_group_references()
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def one(model: str, layout: str) -> dict[str, float]:
    """One survivor's re-formation: the old layout's engine (not timed), released with an
    optimizer state, then the new layout's engine built around it and the state loaded."""
    import torch

    from elastic.checkpoint.restore import flat_target, load_live_into
    from elastic.engine import TrainEngine
    from elastic.parallel.dims import ParallelDims
    from elastic.parallel.live import release
    from jobs import JobSpec

    dp0, dp1 = LAYOUTS[layout]
    spec = JobSpec.from_dict(spec_dict(f"{layout}_{model}", 1))  # the layout's DP degree is set below
    group = spec.parallel.shard_group
    _group(dp0)
    engine = TrainEngine(spec.model, spec.parallel, spec.train, ParallelDims(dp0, 1, 1, dp0, shard_group=group), 0)
    for p in engine.model.parameters():  # an AdamW state for every parameter, as after a step
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    objects = flat_target(engine)[1]
    live = release(engine, 1, 0)
    del engine
    gc.collect()
    _group(dp1)
    dims = ParallelDims(dp1, 1, 1, dp1, shard_group=group)
    dims.build_mesh("cpu")  # the rendezvous' part, timed by recovery_scaling as rendezvous_s
    cpu0, t0 = time.process_time(), time.perf_counter()
    engine = TrainEngine(spec.model, spec.parallel, spec.train, dims, 0, restoring=True, adopt=live)
    t1 = time.perf_counter()
    if live.params is not None:  # as ``Trainer.load_live``: a module kept whole (DDP) holds its state
        load_live_into(engine, live, objects)
    t2 = time.perf_counter()
    out = {"rebuild_s": t1 - t0, "restore_s": t2 - t1, "total_s": t2 - t0, "cpu_s": time.process_time() - cpu0}
    del engine, live
    gc.collect()
    return out


def run(reps: int, models: list[str], layouts: list[str]) -> dict[str, Any]:
    gc.collect()
    gc.freeze()  # as a worker settles its heap at its start (elastic/worker/heap.py)
    rows: dict[str, list[dict[str, float]]] = {f"{lay}_{m}": [] for lay in layouts for m in models}
    load = [os.getloadavg()[0]]
    for _ in range(reps + 1):  # the first round warms up (imports, first allocations) and is dropped
        for lay in layouts:
            for m in models:
                rows[f"{lay}_{m}"].append(one(m, lay))
        load.append(os.getloadavg()[0])
    results = {k: {t: median_range(r[t] for r in v[1:]) for t in TIMED} for k, v in rows.items()}
    ratios = {}
    for lay in layouts:
        base = results.get(f"{lay}_50mb")
        for m in models:
            if m != "50mb" and base is not None:
                ratios[f"{lay}_{m}_over_50mb"] = {
                    t: round(results[f"{lay}_{m}"][t]["median"] / base[t]["median"], 3) for t in ("total_s", "cpu_s")
                }
    return {"reps": reps, "results": results, "ratios": ratios, "load_1min": load}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    add_choice_list(ap, "models", MODELS)
    add_choice_list(ap, "layouts", LAYOUTS)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    models = chosen(ap, args.models, MODELS, "models")
    layouts = chosen(ap, args.layouts, LAYOUTS, "layouts")
    if args.reps < 1:
        ap.error("--reps: must be at least 1")
    import torch

    torch.set_num_threads(1)  # one intra-op thread, as each rank of recovery_scaling has one core
    out = run(args.reps, models, layouts)
    print(f"survivor rebuild, {args.reps} reps (after one warm-up), one process, 1 thread; load {out['load_1min']}")
    for key, res in out["results"].items():
        total, cpu = res["total_s"], res["cpu_s"]
        print(
            f"  {key:>14}: {total['median'] * 1e3:7.1f} ms [{total['min'] * 1e3:.1f}, {total['max'] * 1e3:.1f}]"
            f"  (rebuild {res['rebuild_s']['median'] * 1e3:.1f}, restore {res['restore_s']['median'] * 1e3:.1f};"
            f" cpu {cpu['median'] * 1e3:.1f})"
        )
    print("ratios (median, 0.5 GB over 50 MB):", json.dumps(out["ratios"]))
    if args.json:
        from benchmarks.harness.results import write_json

        write_json(args.json, {**out, "date_utc": utc_stamp(), "machine": machine()})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
