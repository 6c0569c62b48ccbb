"""How long checkpointing holds the training loop: async vs sync storage, and memory snapshots.

One process trains one model (the project's ``TrainEngine`` on a world-1 gloo group) and
checkpoints it with the runtime's own classes, exactly as ``TrainWorker._train_one_step``
does: ``MemoryTier.snapshot_async`` after the optimizer step, ``StorageUploader.save`` for
the storage tier (to a local directory), ``MemoryTier.wait`` before the next optimizer step.
Three phases run back to back on the same model state:

1. memory tier only: a snapshot every step;
2. storage tier, ``async: true``: a checkpoint every other step;
3. storage tier, ``async: false`` (the baseline): a checkpoint every step.

Training-blocking time of a checkpoint = building the state dict + starting the snapshot +
the storage tier's call in the loop + the wait for the copy before the next optimizer step.
(The final flush of async uploads happens after the loop and is reported separately: no
training is held by it.) Printed figures are ratios measured side by side::

    storage: async/sync blocking = X.XX% (goal <= 2%)
    memory:  snapshot blocking / step time = X.XX% (goal <= 3%)

Usage: ``.venv/bin/python benchmarks/checkpoint_stall.py [--d-model 512] [--layers 8]``
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elastic.checkpoint.memory_tier import MemoryTier  # noqa: E402
from elastic.checkpoint.storage_tier import StorageUploader  # noqa: E402
from elastic.parallel.dims import ParallelDims  # noqa: E402
from elastic.parallel.engine import TrainEngine  # noqa: E402
from jobs import JobSpec  # noqa: E402
from storage import RankWriteResult, commit_checkpoint  # noqa: E402


def make_spec(args: argparse.Namespace, uri: str, async_: bool) -> JobSpec:
    return JobSpec.from_dict({
        "model": {"n_layers": args.layers, "d_model": args.d_model, "n_heads": 8, "vocab_size": args.vocab, "seq_len": args.seq},
        "parallel": {"micro_batch": 2}, "elastic": {"min_dp": 1, "max_dp": 1},
        "train": {"steps": 10_000, "global_batch": 4, "lr": 1e-4},
        "checkpoint": {"uri": uri, "every_steps": 1, "async": async_, "keep": 1},
    })


class Loop:
    """The worker's step, stripped of data loading and the controller."""

    def __init__(self, engine: TrainEngine, seq: int, vocab: int):
        self.engine, self.tier, self.step = engine, MemoryTier(), 0
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (4, seq + 1), generator=g)
        self.batches = [(tokens[i:i + 2, :-1], tokens[i:i + 2, 1:]) for i in (0, 2)]
        self.pending = 0.0  # blocking of the last checkpoint still to be completed by the next wait

    def run(self, checkpoints: int, uploader: StorageUploader | None = None, every: int = 1) -> tuple[list[float], list[float]]:
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


def storage_phase(loop: Loop, args: argparse.Namespace, root: str, async_: bool, checkpoints: int) -> dict:
    spec = make_spec(args, root, async_)
    results: collections.deque = collections.deque()
    uploader = StorageUploader(spec, root, 0, loop.engine.dims, loop.tier, results, base_step=loop.step)
    every = 2 if async_ else 1
    t0 = time.perf_counter()
    compute, blocking = loop.run(checkpoints, uploader, every)
    flush = uploader.flush(600)
    wall = time.perf_counter() - t0
    ups = [r for r in results if r["type"] == "upload"]
    errors = [r["error"] for r in ups if r["error"]]
    if errors:
        raise SystemExit(f"upload failed: {errors[0]}")
    for r in ups:  # commit, so what was written is a real checkpoint
        commit_checkpoint(uploader.store, r["step"], [RankWriteResult.from_dict(r["result"])])
    return {"blocking": blocking, "compute": compute, "flush_s": flush, "wall_s": wall,
            "bytes": statistics.mean(r["bytes"] for r in ups), "upload_s": statistics.mean(r["duration_s"] for r in ups)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--dir", default=None, help="local checkpoint directory (default: a temporary one)")
    args = p.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-stall-")
    try:
        spec = make_spec(args, root, True)
        engine = TrainEngine(spec.model, spec.parallel, spec.train, ParallelDims(1, 1, 1, 1), spec.seed)
        params = sum(p.numel() for p in engine.model.parameters())
        loop = Loop(engine, args.seq, args.vocab)
        loop.run(1)  # warm up: allocator, AdamW state, snapshot buffers
        mem_compute, mem_blocking = loop.run(4)
        asyn = storage_phase(loop, args, os.path.join(root, "async"), True, args.checkpoints)
        sync = storage_phase(loop, args, os.path.join(root, "sync"), False, args.checkpoints)
    finally:
        dist.destroy_process_group()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    ms = lambda xs: 1e3 * statistics.mean(xs)  # noqa: E731
    step_ms, snap_ms = ms(mem_compute), ms(mem_blocking)
    print(f"model: d_model={args.d_model} layers={args.layers} vocab={args.vocab} seq={args.seq}: "
          f"{params / 1e6:.1f}M params, checkpoint {asyn['bytes'] / 1e6:.0f} MB per step; torch threads {torch.get_num_threads()}")
    print(f"step compute (fwd+bwd+optimizer): {step_ms:.0f} ms")
    print(f"{'':24}{'blocking per ckpt (ms)':>24}{'upload (ms)':>14}{'per-ckpt values (ms)':>40}")
    for name, r in (("storage async", asyn), ("storage sync", sync)):
        vals = ", ".join(f"{1e3 * b:.0f}" for b in r["blocking"])
        print(f"{name:24}{ms(r['blocking']):>24.1f}{1e3 * r['upload_s']:>14.0f}{vals:>40}")
    print(f"{'memory snapshot':24}{snap_ms:>24.1f}{'-':>14}{', '.join(f'{1e3 * b:.1f}' for b in mem_blocking):>40}")
    print(f"async: final flush after the loop {asyn['flush_s'] * 1e3:.0f} ms (not training-blocking)")
    ratio_storage = ms(asyn["blocking"]) / ms(sync["blocking"])
    ratio_memory = snap_ms / step_ms
    print(f"storage: async/sync blocking = {100 * ratio_storage:.2f}% (goal <= 2%)")
    print(f"memory:  snapshot blocking / step time = {100 * ratio_memory:.2f}% (goal <= 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
