"""A survivor's first step after a re-formation, against its next steps: 2 real gloo ranks.

In whole recoveries on this 2-core host the first step at the new size is often slower than
the steps after it: ``recovery_vs_raytrain --model 100m`` (2026-11-29 06:45 UTC, load 3.8)
gave 4.39 s for it against 2.86-4.47 s for the ten after. That step is not part of the
re-formation cost ``recovery_scaling`` reports, but it is part of the downtime, and a
survivor could pay for what it kept: a DDP wrapper made anew over the kept module, its
buckets allocated and touched again, FSDP's parameters set up around adopted shards.

This benchmark takes the survivors' part alone. Two processes (one per core), each a rank of
a real gloo group, run the worker's own code: each generation builds a ``TrainEngine`` (the
first from scratch; each later one with ``restoring=True, adopt=`` the ``LiveState`` that
``release`` took out of the engine before, and ``load_live_into`` where shards were kept, as
``Trainer.load_live`` does), trains ``--steps`` steps, and lets its engine and group go as a
failure does; the next generation forms a new group on the same store. Each step's forward,
backward and optimizer step is timed on both ranks (the larger of the two counts), after a
barrier. Models are ``recovery_scaling``'s: ``50mb`` (4 blocks), ``500mb`` (8 blocks, 0.54
GB of state). Layouts: ``ddp`` (zero 0: the module kept whole and wrapped again) and
``hsdp`` (zero 3, one shard group of 2: each rank keeps its shards).

Printed per model and layout: the first step of the adopted generations, the steps after it,
their ratio (median and range over the generations), and the first step of the cold first
generation for comparison.

Usage::

    .venv/bin/python -m benchmarks.survivor_first_step [--generations 3] [--steps 4] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from typing import Any

from benchmarks.harness.options import add_choice_list, chosen
from benchmarks.harness.results import machine, utc_stamp
from benchmarks.harness.stats import median_range
from benchmarks.recovery_scaling import spec_dict

MODELS = ("50mb", "500mb")
LAYOUTS = ("ddp", "hsdp")
WORLD = 2
STORE_TIMEOUT_S = 120.0


def _rank(rank: int, port: int, cfg: dict[str, Any]) -> None:
    """One rank: ``cfg['generations']`` generations of ``cfg['steps']`` timed steps each."""
    import gc
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from elastic.checkpoint.restore import flat_target, load_live_into
    from elastic.engine import TrainEngine
    from elastic.parallel.dims import ParallelDims
    from elastic.parallel.live import release
    from elastic.worker.process_group import _drop_torch_group_references
    from jobs import JobSpec

    torch.set_num_threads(1)
    spec = JobSpec.from_dict(spec_dict(f"{cfg['layout']}_{cfg['model']}", 1))
    group = spec.parallel.shard_group and WORLD
    grad_accum = spec.train.global_batch // (WORLD * spec.parallel.micro_batch)
    g = torch.Generator().manual_seed(rank)
    shape = (spec.parallel.micro_batch, spec.model.seq_len)
    vocab = spec.model.vocab_size
    batches = [
        (torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
        for _ in range(grad_accum)
    ]
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    live = objects = None
    gens: list[list[float]] = []
    for gen in range(cfg["generations"] + 1):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}/", store), rank=rank, world_size=WORLD)
        dims = ParallelDims(WORLD, 1, 1, WORLD, shard_group=group)
        dims.build_mesh("cpu")
        engine = TrainEngine(spec.model, spec.parallel, spec.train, dims, 0, restoring=live is not None, adopt=live)
        if live is not None and live.params is not None:
            load_live_into(engine, live, objects)
        times = []
        for _ in range(cfg["steps"]):
            dist.barrier()
            t0 = time.perf_counter()
            engine.forward_backward(batches)
            engine.optimizer_step()
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(float(took))
        gens.append(times)
        objects = flat_target(engine)[1]
        live = release(engine, cfg["steps"] * (gen + 1), rank)
        del engine
        _drop_torch_group_references()
        dist.destroy_process_group()
        gc.collect()
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(gens, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(model: str, layout: str, generations: int, steps: int) -> dict[str, Any]:
    """Spawn the two ranks for one model and layout; their step times by generation."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"model": model, "layout": layout, "generations": generations, "steps": steps}
        cfg["out"] = os.path.join(tmp, "steps.json")
        mp.spawn(_rank, args=(_free_port(), cfg), nprocs=WORLD, join=True)
        with open(cfg["out"]) as f:
            gens = json.load(f)
    cold, adopted = gens[0], gens[1:]
    after = [median_range(g[1:])["median"] for g in adopted]
    return {
        "cold_first_s": cold[0],
        "cold_after_s": median_range(cold[1:]),
        "first_s": median_range(g[0] for g in adopted),
        "after_s": median_range(after),
        "first_over_after": median_range(g[0] / a for g, a in zip(adopted, after)),
        "steps_by_generation": gens,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generations", type=int, default=3, help="re-formations after the first generation")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per generation (at least 2)")
    add_choice_list(ap, "models", MODELS)
    add_choice_list(ap, "layouts", LAYOUTS)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    models = chosen(ap, args.models, MODELS, "models")
    layouts = chosen(ap, args.layouts, LAYOUTS, "layouts")
    if args.generations < 1:
        ap.error("--generations: must be at least 1")
    if args.steps < 2:
        ap.error("--steps: must be at least 2")
    load = [os.getloadavg()[0]]
    results = {}
    print(
        f"survivor first step: {WORLD} gloo ranks, 1 thread each, {args.generations} re-formations x {args.steps} steps"
    )
    for model in models:
        for layout in layouts:
            res = results[f"{layout}_{model}"] = one(model, layout, args.generations, args.steps)
            load.append(os.getloadavg()[0])
            first, after, ratio = res["first_s"], res["after_s"], res["first_over_after"]
            print(
                f"  {layout + '_' + model:>11}: first {first['median']:.3f} s [{first['min']:.3f}, {first['max']:.3f}]"
                f" vs after {after['median']:.3f} s [{after['min']:.3f}, {after['max']:.3f}]:"
                f" {ratio['median']:.2f}x [{ratio['min']:.2f}, {ratio['max']:.2f}]"
                f" (cold start: first {res['cold_first_s']:.3f} s, after {res['cold_after_s']['median']:.3f} s)"
            )
    print(f"load (1 min) before and after each: {load}")
    if args.json:
        from benchmarks.harness.results import write_json

        out = {"generations": args.generations, "steps": args.steps, "results": results, "load_1min": load}
        write_json(args.json, {**out, "date_utc": utc_stamp(), "machine": machine()})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
