"""Feeding a TP group: every TP rank reads its batch, or TP rank 0 reads and broadcasts?

The ranks of one tensor-parallel group belong to the same model replica (the same DP rank),
so they train on the same micro-batches. Two ways to get them there, measured side by side
on 2 spawned ranks (gloo on 127.0.0.1, one torch thread each) forming one TP group (the
``tp`` sub-group of a ``ParallelDims(dp=1, tp=2, pp=1)`` mesh, as the engine builds it):

* ``read``: each TP rank reads its DP rank's micro-batches from the parquet corpus itself
  (``ParquetCorpus.rows`` on ``BatchLayout.micro_batches``, exactly what ``RankStream``
  does), each with its own ``ParquetCorpus`` (own row-group cache, as separate workers have);
* ``bcast``: TP rank 0 reads the same rows (its own, separate ``ParquetCorpus``) and
  broadcasts them over the TP group as one int64 tensor ``[rows, seq_len + 1]``; rank 1
  receives into a preallocated buffer; both then cut it into ``(inputs, targets)``
  micro-batches;
* ``bcast-i32``: as ``bcast``, but the tokens travel as int32 (half the bytes) and are
  widened back to int64 on arrival.

Every step runs all methods on the same batch index, in an order that rotates from step to
step, so load drift on a shared machine and cache effects fall on all alike. Each method's
step starts after a barrier. Per step and method:

* ``wall``: the slowest rank's time to hold its micro-batches (the step cannot start
  earlier). Row-group reads are bursty: a DP rank's slice advances by ``global_batch``
  rows per step, so one parquet decode (1024-row groups) every ``1024 / global_batch``
  steps, cache hits otherwise. So the per-step cost is reported as ``amortized`` = median
  of the cache-hit steps and median of the fetch steps (those where ``bytes_read`` grew),
  mixed at the measured fetch rate. Medians, because a stall caused by another user of a
  shared machine would otherwise decide a mean; the raw mean is printed next to it;
* ``cpu``: process CPU time summed over the two ranks (gloo's threads included), the cost
  on a machine whose cores are shared with training;
* ``storage``: row-group bytes fetched per step, both ranks together (``ParquetCorpus.bytes_read``).

The rank-1 tensors of every method are compared with each other every step (``same data``).

Two shapes are measured by default: the quickstart's (seq_len 64, micro_batch 4, global
batch 48 at dp 2) and a long-sequence one (seq_len 2048, micro_batch 1, global batch 16 at
dp 2). Synthetic corpora are written once to a temporary directory with
``elastic.ingest.corpus.synthetic_corpus``; ``--corpus URI`` measures an existing parquet corpus.

Usage::

    .venv/bin/python -m benchmarks.tp_data_sharing [--steps N] [--shapes quickstart,long]
        [--corpus file:///data/corpus --seq N --micro-batch N --global-batch N --dp N] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness.results import write_stamped
from elastic.ingest.corpus import BatchLayout, ParquetCorpus, synthetic_corpus
from elastic.parallel.dims import ParallelDims
from elastic.testing.ports import free_port as _free_port

METHODS = ("read", "bcast", "bcast-i32")
SHAPES = {
    # name: (seq_len, micro_batch, global_batch, dp, corpus rows, default measured steps)
    # Enough steps for >= 15 row-group fetches per corpus; more rows than the 8-group cache.
    "quickstart": (64, 4, 48, 2, 20_000, 1000),
    "long": (2048, 1, 16, 2, 16_384, 2000),
}
VOCAB = 512


def split(rows: torch.Tensor, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[n, seq+1]`` token rows -> ``(inputs, targets)`` micro-batches, as ``RankStream`` makes them."""
    return [
        (rows[i : i + micro_batch, :-1].contiguous(), rows[i : i + micro_batch, 1:].contiguous())
        for i in range(0, rows.shape[0], micro_batch)
    ]


def rank_main(rank: int, world: int, cfg: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    dims = ParallelDims(dp=1, tp=world, pp=1, world_size=world)
    dims.build_mesh("cpu")
    tp_group = dims.tp_mesh.get_group()
    tp_rank = dims.local_coords().tp_rank
    results = {}
    for shape in cfg["shapes"]:
        layout = BatchLayout(global_batch=shape["global_batch"], micro_batch=shape["micro_batch"], dp=shape["dp"])
        dp_rank = 0  # both TP ranks belong to the same replica; which DP rank does not matter
        width = shape["seq_len"] + 1
        corpora = {m: ParquetCorpus(shape["uri"]) for m in METHODS if m == "read" or tp_rank == 0}
        buffers = {
            "bcast": torch.empty((layout.per_rank, width), dtype=torch.int64),
            "bcast-i32": torch.empty((layout.per_rank, width), dtype=torch.int32),
        }

        # Called within this iteration only, so binding the loop's names late is intended.
        def produce(method: str, batch: int, layout=layout, dp_rank=dp_rank, corpora=corpora, buffers=buffers):
            if method == "read":
                # One read per micro-batch, as RankStream._read does.
                return [
                    pair
                    for idx in layout.micro_batches(batch, dp_rank)
                    for pair in split(torch.from_numpy(corpora["read"].rows(idx)), layout.micro_batch)
                ]
            buf = buffers[method]
            if tp_rank == 0:
                rows = corpora[method].rows(layout.rank_samples(batch, dp_rank))
                buf = torch.from_numpy(rows if method == "bcast" else rows.astype(np.int32))
            dist.broadcast(buf, group=tp_group, group_src=0)
            return split(buf if method == "bcast" else buf.to(torch.int64), layout.micro_batch)

        wall = {m: [] for m in METHODS}
        cpu = {m: [] for m in METHODS}
        fetched = {m: [] for m in METHODS}  # 1.0 where this step decoded a row group
        mismatches = 0
        for step in range(cfg["warmup"] + shape["steps"]):
            batch = shape["start_batch"] + step
            order = METHODS[step % len(METHODS) :] + METHODS[: step % len(METHODS)]
            got = {}
            for method in order:
                dist.barrier(group=tp_group)
                before = corpora[method].bytes_read if method in corpora else 0
                c0, t0 = time.process_time(), time.perf_counter()
                got[method] = produce(method, batch)
                t1, c1 = time.perf_counter(), time.process_time()
                if step >= cfg["warmup"]:
                    wall[method].append(t1 - t0)
                    cpu[method].append(c1 - c0)
                    after = corpora[method].bytes_read if method in corpora else 0
                    fetched[method].append(float(after > before))
            ref = got["read"]
            for method in METHODS[1:]:
                if len(got[method]) != len(ref) or not all(
                    torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(ref, got[method])
                ):
                    mismatches += 1
        # Slowest rank per step (wall), sum over ranks (cpu, storage bytes).
        w = {m: torch.tensor(wall[m], dtype=torch.float64) for m in METHODS}
        c = {m: torch.tensor(cpu[m], dtype=torch.float64) for m in METHODS}
        fe = {m: torch.tensor(fetched[m], dtype=torch.float64) for m in METHODS}
        for m in METHODS:
            dist.all_reduce(w[m], op=dist.ReduceOp.MAX, group=tp_group)
            dist.all_reduce(c[m], op=dist.ReduceOp.SUM, group=tp_group)
            dist.all_reduce(fe[m], op=dist.ReduceOp.MAX, group=tp_group)
        read_bytes = torch.tensor(
            [float(corpora[m].bytes_read) if m in corpora else 0.0 for m in METHODS], dtype=torch.float64
        )
        dist.all_reduce(read_bytes, group=tp_group)
        bad = torch.tensor([mismatches])
        dist.all_reduce(bad, group=tp_group)
        results[shape["name"]] = {
            "wall_s": {m: w[m].tolist() for m in METHODS},
            "cpu_s": {m: c[m].tolist() for m in METHODS},
            "fetched": {m: fe[m].tolist() for m in METHODS},
            "storage_bytes": dict(zip(METHODS, read_bytes.tolist())),
            "mismatched_steps": int(bad),
            "rows_per_step": layout.per_rank,
        }
    if tp_rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _stats(wall: list[float], cpu: list[float], fetched: list[float]) -> dict:
    """Per-step cost split into cache hits and row-group fetches (see ``main``'s legend)."""
    hits = [w for w, f in zip(wall, fetched) if not f]
    fetches = [w for w, f in zip(wall, fetched) if f]
    frac = len(fetches) / len(wall)
    hit_p50 = statistics.median(hits) if hits else 0.0
    fetch_p50 = statistics.median(fetches) if fetches else 0.0
    return {
        "wall_hit_p50_s": hit_p50,
        "wall_fetch_p50_s": fetch_p50,
        "fetch_steps": len(fetches),
        "wall_amortized_s": (1 - frac) * hit_p50 + frac * fetch_p50,
        "wall_mean_s": statistics.fmean(wall),
        "wall_max_s": max(wall),
        "cpu_mean_s": statistics.fmean(cpu),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured steps per shape (default: quickstart 1000, long 2000; --corpus 1000)",
    )
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    ap.add_argument("--corpus", default=None, help="measure this parquet corpus URI instead of synthetic ones")
    ap.add_argument("--seq", type=int, default=64, help="with --corpus: its rows have seq+1 tokens")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--start-batch", type=int, default=0)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tp_data_sharing-") as tmp:
        shapes = []
        if args.corpus:
            shapes.append(
                {
                    "name": "corpus",
                    "uri": args.corpus,
                    "seq_len": args.seq,
                    "micro_batch": args.micro_batch,
                    "global_batch": args.global_batch,
                    "dp": args.dp,
                    "start_batch": args.start_batch,
                    "steps": args.steps or 1000,
                }
            )
        else:
            for name in [n.strip() for n in args.shapes.split(",") if n.strip()]:
                if name not in SHAPES:
                    ap.error(f"unknown shape {name!r}; choose from {list(SHAPES)}")
                seq, mb, gb, dp, n, steps = SHAPES[name]
                uri = synthetic_corpus(os.path.join(tmp, "data"), n, seq, VOCAB, seed=0)
                shapes.append(
                    {
                        "name": name,
                        "uri": uri,
                        "seq_len": seq,
                        "micro_batch": mb,
                        "global_batch": gb,
                        "dp": dp,
                        "start_batch": args.start_batch,
                        "steps": args.steps or steps,
                    }
                )
        cfg = {"port": _free_port(), "shapes": shapes, "warmup": args.warmup}
        mp.start_processes(rank_main, args=(2, cfg, tmp), nprocs=2, join=True, start_method="spawn")
        with open(os.path.join(tmp, "result.json")) as f:
            results = json.load(f)
    wall_total = time.perf_counter() - t_start

    print()
    print(
        f"TP data sharing: one TP group of 2 ranks (gloo, 1 thread each), "
        f"methods interleaved per step; run took {wall_total:.0f}s"
    )
    summary = {}
    for shape in shapes:
        r = results[shape["name"]]
        n = shape["steps"]
        mb_bytes = r["rows_per_step"] * (shape["seq_len"] + 1) * 8
        print()
        print(
            f"[{shape['name']}] seq_len={shape['seq_len']} micro_batch={shape['micro_batch']} "
            f"global_batch={shape['global_batch']} dp={shape['dp']}, {n} steps: {r['rows_per_step']} rows = "
            f"{mb_bytes / 1024:.1f} KiB of int64 tokens per rank per step; "
            "same data on every step: "
            f"{'yes' if r['mismatched_steps'] == 0 else 'NO (' + str(r['mismatched_steps']) + ' steps differ)'}"
        )
        hdr = (
            f"  {'method':<10}{'hit p50':>9}{'fetch p50':>11}{'(n)':>5}{'amortized':>11}{'x read':>8}"
            f"{'raw mean':>10}{'cpu mean':>10}{'x read':>8}{'storage/step':>14}"
        )
        print(hdr)
        print("  " + "-" * (len(hdr) - 2))
        rows = {m: _stats(r["wall_s"][m], r["cpu_s"][m], r["fetched"][m]) for m in METHODS}
        for m in METHODS:
            rows[m]["storage_bytes_per_step"] = r["storage_bytes"][m] / (n + args.warmup)
        base_w, base_c = rows["read"]["wall_amortized_s"], rows["read"]["cpu_mean_s"]
        for m in METHODS:
            x = rows[m]
            fetch = "-" if x["fetch_steps"] == 0 else f"{x['wall_fetch_p50_s'] * 1e3:.2f}ms"
            print(
                f"  {m:<10}{x['wall_hit_p50_s'] * 1e3:>7.3f}ms{fetch:>11}{x['fetch_steps']:>5}"
                f"{x['wall_amortized_s'] * 1e3:>9.3f}ms{x['wall_amortized_s'] / base_w:>8.2f}"
                f"{x['wall_mean_s'] * 1e3:>8.3f}ms{x['cpu_mean_s'] * 1e3:>8.3f}ms{x['cpu_mean_s'] / base_c:>8.2f}"
                f"{x['storage_bytes_per_step'] / 1024:>11.1f}KiB"
            )
        best = min(METHODS[1:], key=lambda m: rows[m]["wall_amortized_s"])
        ratio = rows[best]["wall_amortized_s"] / base_w
        hits = rows[best]["wall_hit_p50_s"] / rows["read"]["wall_hit_p50_s"]
        fetches = (
            rows[best]["wall_fetch_p50_s"] / rows["read"]["wall_fetch_p50_s"]
            if rows["read"]["fetch_steps"] and rows[best]["fetch_steps"]
            else float("nan")
        )
        if ratio < 0.9:
            rec = (
                f"broadcast ({best}): {1 / ratio:.2f}x cheaper per step than every TP rank reading "
                f"(x{hits:.2f} on cache hits, x{fetches:.2f} on row-group fetches: one decode per group "
                f"instead of one per TP rank)"
            )
        elif ratio > 1.1:
            rec = (
                f"each TP rank reads (as RankStream does): {ratio:.2f}x cheaper per step than the best broadcast "
                f"({best}); broadcast only pays where storage reads are the bottleneck"
            )
        else:
            rec = (
                f"a wash on time ({best}/read = {ratio:.2f}): keep per-rank reads (off the critical path in the "
                f"prefetch thread); broadcast only to halve storage reads"
            )
        print(f"  -> recommendation: {rec}")
        summary[shape["name"]] = {
            "shape": shape,
            "methods": rows,
            "recommendation": rec,
            "best_broadcast": best,
            "best_broadcast_over_read": {"amortized": ratio, "hits": hits, "fetches": fetches},
            "mismatched_steps": r["mismatched_steps"],
            "raw": r,
        }
    print()
    print("wall = slowest TP rank's time to hold its micro-batches. hit p50 = median over steps that decoded no row")
    print("group, fetch p50 = median over steps that did (n of them), amortized = their mix at the measured fetch rate")
    print(
        "(medians, so that a stall caused by another user of the machine does not decide it); raw mean for reference."
    )
    print("cpu = process CPU time of both ranks; storage = row-group bytes (ParquetCorpus.bytes_read) fetched per")
    print("step, both ranks. Caveats: both ranks share this machine's cores with each other (and other users), so two")
    print("simultaneous decodes contend more than on a host with a core per rank; storage is a local file (page")
    print("cache), while on s3:// a read costs a round trip and the broadcast also halves request count and egress.")
    print("In the worker, reads run in RankStream's prefetch thread, off the step's critical path; a broadcast is a")
    print("collective that must be issued in the same order on both ranks.")
    if args.json_out:
        doc = {
            "config": vars(args),
            "wall_s": wall_total,
            "shapes": summary,
        }
        write_stamped(args.json_out, doc)


if __name__ == "__main__":
    main()
