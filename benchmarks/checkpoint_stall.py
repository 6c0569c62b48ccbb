"""How long checkpointing holds the training loop: async vs sync storage, and memory snapshots.

One process trains one model (the project's ``TrainEngine`` on a world-1 gloo group) and
checkpoints it with the runtime's own classes, exactly as ``TrainWorker._train_one_step``
does: ``MemoryTier.snapshot_async`` after the optimizer step, ``StorageUploader.save`` for
the storage tier (to a local directory), ``MemoryTier.wait`` before the next optimizer step.
Three phases run back to back on the same model state, each ``--checkpoints`` checkpoints
long (default 10) at the same interval (``--every`` steps, default 5):

1. memory tier only: the same snapshots, nothing written (the reference for step times);
2. storage tier, ``async: true``;
3. storage tier, ``async: false`` (the baseline).

Training-blocking time of a checkpoint = building the state dict + starting the snapshot +
the storage tier's call in the loop + the wait for the copy before the next optimizer step.
The final flush of async uploads happens after the loop and is reported separately: no
training is held by it. Background uploads are not free either: their serialisation,
checksums and writes take CPU that the training steps would otherwise have, which shows as
slower steps on a small machine. That slowdown is printed next to the blocking time, as is
the end-to-end cost (phase wall time, all included, against the memory-only phase).
Printed figures are ratios measured side by side::

    storage: async/sync blocking = X.XX% (goal <= 2%)
    storage: async uploads slow the training steps by X.X% (compute per step vs memory-only phase)
    storage: phase wall time vs memory-only: async +X.X%, sync +X.X%
    memory:  snapshot blocking / step time = X.XX% (goal <= 3%)

Usage: ``.venv/bin/python -m benchmarks.checkpoint_stall [--d-model 512] [--layers 8] [--checkpoints 10] [--every 5]``
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.harness.results import utc_stamp, write_json
from benchmarks.harness.stats import summary
from elastic.checkpoint.memory_tier import MemoryTier
from elastic.checkpoint.storage_tier import StorageUploader
from elastic.engine import TrainEngine
from elastic.messages import UploadReport
from elastic.parallel.dims import ParallelDims
from elastic.testing.ports import free_port
from jobs import JobSpec
from storage import RankWriteResult, commit_checkpoint


def make_spec(args: argparse.Namespace, uri: str, async_: bool) -> JobSpec:
    return JobSpec.from_dict(
        {
            "model": {
                "n_layers": args.layers,
                "d_model": args.d_model,
                "n_heads": 8,
                "vocab_size": args.vocab,
                "seq_len": args.seq,
            },
            "parallel": {"micro_batch": 2},
            "elastic": {"min_dp": 1, "max_dp": 1},
            "train": {"steps": 10_000, "global_batch": 4, "lr": 1e-4},
            "checkpoint": {"uri": uri, "every_steps": 1, "async": async_, "keep": 1},
        }
    )


class Loop:
    """The worker's step, stripped of data loading and the controller."""

    def __init__(self, engine: TrainEngine, seq: int, vocab: int):
        self.engine, self.tier, self.step = engine, MemoryTier(), 0
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (4, seq + 1), generator=g)
        self.batches = [(tokens[i : i + 2, :-1], tokens[i : i + 2, 1:]) for i in (0, 2)]
        self.pending = 0.0  # blocking of the last checkpoint still to be completed by the next wait

    def run(
        self, checkpoints: int, uploader: StorageUploader | None = None, every: int = 1
    ) -> tuple[list[float], list[float]]:
        """``checkpoints`` checkpoints, one every ``every`` steps, and one more step after the last
        (whose wait completes the last one's blocking). Returns (compute s per step, blocking s per checkpoint)."""
        compute, blocking = [], []
        for i in range(checkpoints * every + 1):
            t0 = time.perf_counter()
            self.engine.forward_backward(self.batches)
            t1 = time.perf_counter()
            wait = self.tier.wait()
            t2 = time.perf_counter()
            self.engine.optimizer_step()
            compute.append((t1 - t0) + (time.perf_counter() - t2))
            if blocking:
                blocking[-1] += wait  # the copy started by the last checkpoint held this step
            self.step += 1
            if (i + 1) % every == 0 and len(blocking) < checkpoints:
                b0 = time.perf_counter()
                state = {"app": self.engine.state_dict(), "train": {"step": self.step, "batch_index": self.step}}
                start = self.tier.snapshot_async(self.step, 0, state, {"dp": 1})
                if uploader is not None:
                    uploader.save(self.step, state, start)
                blocking.append(time.perf_counter() - b0)
            if uploader is not None:
                uploader.secure(self.step)
        return compute, blocking


def storage_phase(loop: Loop, args: argparse.Namespace, root: str, async_: bool | None) -> dict:
    """``args.checkpoints`` checkpoints every ``args.every`` steps; ``async_`` None: memory tier only."""
    uploader, results = None, collections.deque()
    if async_ is not None:
        spec = make_spec(args, root, async_)
        uploader = StorageUploader(spec, root, 0, loop.engine.dims, loop.tier, results, base_step=loop.step)
    t0 = time.perf_counter()
    compute, blocking = loop.run(args.checkpoints, uploader, args.every)
    loop_wall = time.perf_counter() - t0
    flush = uploader.flush(600) if uploader is not None else 0.0
    ups = [r for r in results if isinstance(r, UploadReport)]
    errors = [r.error for r in ups if r.error]
    if errors:
        raise SystemExit(f"upload failed: {errors[0]}")
    for r in ups:  # commit, so what was written is a real checkpoint
        commit_checkpoint(uploader.store, r.step, [RankWriteResult.from_dict(r.result)])
    if uploader is not None and len(ups) != args.checkpoints:
        raise SystemExit(f"{len(ups)} uploads for {args.checkpoints} checkpoints")
    return {
        "blocking": blocking,
        "compute": compute,
        "flush_s": flush,
        "loop_wall_s": loop_wall,
        "bytes": statistics.mean(r.bytes for r in ups) if ups else 0,
        "upload_s": statistics.mean(r.duration_s for r in ups) if ups else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--checkpoints", type=int, default=10, help="checkpoints per phase (default 10)")
    p.add_argument(
        "--every", type=int, default=5, help="steps between checkpoints, the same for every phase (default 5)"
    )
    p.add_argument("--reps", type=int, default=3, help="rounds of the three phases, alternating (default 3)")
    p.add_argument("--dir", default=None, help="local checkpoint directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write the per-round figures and their medians to this file")
    args = p.parse_args(argv)
    started = utc_stamp()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-stall-")
    try:
        spec = make_spec(args, root, True)
        engine = TrainEngine(spec.model, spec.parallel, spec.train, ParallelDims(1, 1, 1, 1), spec.seed)
        params = sum(p.numel() for p in engine.model.parameters())
        loop = Loop(engine, args.seq, args.vocab)
        loop.run(1)  # warm up: allocator, AdamW state, snapshot buffers
        rounds = []
        for rep in range(args.reps):  # phases alternate, so drift in the machine's load falls on all alike
            rounds.append(
                {
                    name: storage_phase(loop, args, os.path.join(root, f"{name}-{rep}"), mode)
                    for name, mode in (("memory", None), ("async", True), ("sync", False))
                }
            )
    finally:
        dist.destroy_process_group()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    ms = lambda xs: 1e3 * statistics.mean(xs)  # noqa: E731
    med = statistics.median
    print(
        f"model: d_model={args.d_model} layers={args.layers} vocab={args.vocab} seq={args.seq}: "
        f"{params / 1e6:.1f}M params, checkpoint {rounds[0]['async']['bytes'] / 1e6:.0f} MB; torch threads "
        f"{torch.get_num_threads()}; {args.checkpoints} checkpoints every {args.every} steps per phase; "
        f"{args.reps} round(s) of the three phases; {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'rep':>3} "
        f"{'phase':10}{'step compute (ms)':>19}{'blocking/ckpt (ms)':>20}{'upload (ms)':>13}{'phase wall (s)':>16}"
        f"  per-ckpt blocking (ms)"
    )
    for rep, rnd in enumerate(rounds):
        for name, r in rnd.items():
            vals = ", ".join(f"{1e3 * b:.0f}" for b in r["blocking"])
            up = f"{1e3 * r['upload_s']:.0f}" if r["upload_s"] else "-"
            print(
                f"{rep:>3} "
                f"{name:10}{ms(r['compute']):>19.1f}{ms(r['blocking']):>20.1f}{up:>13}{r['loop_wall_s']:>16.2f}  {vals}"
            )
    print(
        f"async: final flush after the loop {med(r['async']['flush_s'] for r in rounds) * 1e3:.0f} ms median "
        f"(not training-blocking)"
    )

    def figure(fn) -> str:
        vals = [fn(r) for r in rounds]
        return f"{100 * med(vals):.2f}% (range {100 * min(vals):.2f}..{100 * max(vals):.2f}%)"

    print("medians over the rounds, each round's phases side by side:")
    print(
        f"storage: async/sync blocking = {figure(lambda r: ms(r['async']['blocking']) / ms(r['sync']['blocking']))} "
        f"(goal <= 2%)"
    )
    print(
        f"storage: async uploads slow the training steps by "
        f"{figure(lambda r: ms(r['async']['compute']) / ms(r['memory']['compute']) - 1)} "
        f"(compute per step vs the memory-only phase, {os.cpu_count()} cores)"
    )
    print(
        f"storage: phase wall time vs memory-only: async "
        f"{figure(lambda r: r['async']['loop_wall_s'] / r['memory']['loop_wall_s'] - 1)}, sync "
        f"{figure(lambda r: r['sync']['loop_wall_s'] / r['memory']['loop_wall_s'] - 1)}"
    )
    print(
        f"memory:  snapshot blocking / step time = "
        f"{figure(lambda r: ms(r['memory']['blocking']) / ms(r['memory']['compute']))} (goal <= 3%)"
    )
    if args.json:
        write_results(args, started, params, rounds)
    return 0


def write_results(args: argparse.Namespace, started: str, params: int, rounds: list[dict]) -> None:
    """The figures above as a results file (read by ``elastic simulate``, see docs/simulate.md)."""
    ms = lambda xs: 1e3 * statistics.mean(xs)  # noqa: E731
    per_round = [
        {
            "async_over_sync_blocking": ms(r["async"]["blocking"]) / ms(r["sync"]["blocking"]),
            "memory_blocking_over_step": ms(r["memory"]["blocking"]) / ms(r["memory"]["compute"]),
            "async_step_slowdown": ms(r["async"]["compute"]) / ms(r["memory"]["compute"]) - 1,
            "sync_blocking_s": ms(r["sync"]["blocking"]) / 1e3,
            "async_blocking_s": ms(r["async"]["blocking"]) / 1e3,
            "memory_blocking_s": ms(r["memory"]["blocking"]) / 1e3,
            "step_compute_s": ms(r["memory"]["compute"]) / 1e3,
            "checkpoint_bytes": r["async"]["bytes"],
            "upload_s": r["async"]["upload_s"],
        }
        for r in rounds
    ]

    doc = {
        "benchmark": "benchmarks/checkpoint_stall.py",
        "date_utc": started,
        "finished_utc": utc_stamp(),
        "host": {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "loadavg_1m_after": os.getloadavg()[0]},
        "versions": {"torch": torch.__version__},
        "scenario": {
            "d_model": args.d_model,
            "layers": args.layers,
            "vocab": args.vocab,
            "seq": args.seq,
            "params": params,
            "checkpoints": args.checkpoints,
            "every": args.every,
            "reps": args.reps,
            "torch_threads": torch.get_num_threads(),
        },
        "summary": {key: summary(x[key] for x in per_round) for key in per_round[0]},
        "rounds": per_round,
    }
    write_json(args.json, doc)


if __name__ == "__main__":
    sys.exit(main())
