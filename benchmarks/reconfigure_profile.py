"""Where a re-formation's time goes, inside the workers: leave, join, mesh, engine build, restore.

The survivors of a 4 -> 3 shrink (3 gloo ranks, the model of
``benchmarks/recovery_vs_raytrain.py``, from ``benchmarks/recovery/scenario.py``) re-form
``--generations`` times in a row, as after a failure: each generation leaves the old group,
joins a new one, builds the device mesh
and the training engine (meta model, materialise and seed, DDP wrapper, optimizer),
restores the previous generation's state from its memory snapshot and runs one step.
Every phase is timed on every rank; the slowest rank's time is the one that holds the group
up, so that is what is reported (median and range over generations).

``--variants`` runs several build strategies side by side in the same run, alternating
generation by generation, and prints the ratio of each to the first:

- ``rebuild``: build everything from scratch (the engine as a fresh job would);
- ``reuse``: what the worker does on a re-formation (``TrainEngine(restoring=True)``):
  skip seeding weights that the restore overwrites, and DDP's start-up broadcast of them.

Usage::

    .venv/bin/python -m benchmarks.reconfigure_profile [--generations 8] [--world 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from typing import Any

from benchmarks.harness.stats import median_range
from benchmarks.recovery.scenario import MODEL, spec_dict

PHASES = ("leave_s", "join_s", "mesh_s", "meta_s", "materialize_s", "wrap_s", "optimizer_s", "restore_s", "step_s")


def _rank(rank: int, world: int, out_dir: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from elastic.checkpoint.memory_tier import MemoryTier
    from elastic.checkpoint.restore import load_snapshots_into
    from elastic.engine import TrainEngine
    from elastic.parallel.dims import ParallelDims
    from elastic.testing.ranks import init_group
    from elastic.worker.process_group import _drop_torch_group_references
    from jobs import JobSpec

    gc.collect()
    gc.freeze()  # as the worker does at its start (elastic/worker/actor.py)
    spec = JobSpec.from_dict(spec_dict(10, out_dir))  # data.source must exist; no data is read
    tier = MemoryTier("cpu")
    gen = torch.Generator().manual_seed(rank)
    seq = MODEL["seq_len"]
    accum = spec.train.global_batch // (world * spec.parallel.micro_batch)
    batch = [(torch.randint(0, MODEL["vocab_size"], (1, seq), generator=gen),) * 2 for _ in range(accum)]
    engine, rows, step = None, [], 0
    for g, variant in enumerate(cfg["schedule"]):
        t0 = time.perf_counter()
        engine = None
        _drop_torch_group_references()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        t1 = time.perf_counter()
        init_group(rank, world, os.path.join(out_dir, f"store{g}"))
        t2 = time.perf_counter()
        dims = ParallelDims(dp=world, tp=1, pp=1, world_size=world)
        dims.build_mesh("cpu")
        t3 = time.perf_counter()
        restoring = g > 0 and variant == "reuse"
        engine = TrainEngine(spec.model, spec.parallel, spec.train, dims, spec.seed, restoring=restoring)
        t4 = time.perf_counter()
        if g > 0:
            load_snapshots_into(engine, {rank: tier.get(rank, step)})
        t5 = time.perf_counter()
        engine.forward_backward(batch)
        engine.optimizer_step()
        step += 1
        tier.snapshot_async(step, rank, {"app": engine.state_dict()}, {"dp": world, "tp": 1, "pp": 1, "zero": 0})
        tier.wait()
        t6 = time.perf_counter()
        row = {"variant": variant, "leave_s": t1 - t0, "join_s": t2 - t1, "mesh_s": t3 - t2}
        row.update(engine.build_timings)
        row.update(restore_s=t5 - t4, step_s=t6 - t5, engine_s=t4 - t3)
        rows.append(row)
    dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generations", type=int, default=8, help="re-formations per variant (default 8)")
    ap.add_argument("--world", type=int, default=3, help="ranks in the re-formed group (default 3)")
    ap.add_argument("--variants", default="rebuild,reuse", help="comma-separated: rebuild, reuse")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    # Generation 0 is the job's first build (no restore); then the variants alternate.
    schedule = ["rebuild"] + [v for _ in range(args.generations) for v in variants]
    from elastic.testing.ranks import run_ranks

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_ranks(args.world, _rank, ({"schedule": schedule},), tmp)
    # The group waits for its slowest rank: per generation and phase, the max over ranks.
    gens = [{k: max(r[g][k] for r in per_rank) for k in per_rank[0][g] if k != "variant"} for g in range(len(schedule))]
    out: dict[str, Any] = {"world": args.world, "model": MODEL, "load_before": load, "variants": {}}
    for v in variants:
        rows = [gens[g] for g in range(1, len(schedule)) if schedule[g] == v]
        out["variants"][v] = {
            k: median_range(r[k] for r in rows) for k in (*PHASES, "engine_s") if all(k in r for r in rows)
        }
    out["load_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{args.world} ranks re-form {args.generations} times per variant, model {MODEL}; "
        f"load {load:.1f} -> {out['load_after']:.1f}"
    )
    print(f"{'phase (slowest rank)':22s}" + "".join(f"{v:>26s}" for v in variants))
    for k in (*PHASES, "engine_s"):
        cells = []
        for v in variants:
            s = out["variants"][v].get(k)
            cells.append(f"{s['median'] * 1e3:8.1f} ms ({s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f})" if s else "n/a")
        print(f"{k:22s}" + "".join(f"{c:>26s}" for c in cells))
    base = out["variants"][variants[0]]
    for v in variants[1:]:
        o = out["variants"][v]
        total_b = sum(base[k]["median"] for k in PHASES if k in base)
        total_o = sum(o[k]["median"] for k in PHASES if k in o)
        print(
            f"sum of phase medians: {v} {total_o * 1e3:.1f} ms vs {variants[0]} {total_b * 1e3:.1f} ms: "
            f"ratio {total_o / total_b:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
