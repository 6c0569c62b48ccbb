"""Our engine vs torchtitan on the same Llama 3 model, batch, sequence length and devices.

Anchor: torchtitan (installed from PyPI, ``pip install torchtitan``; nothing copied) builds
its own Llama 3 model from its registry (``torchtitan.models.llama3.model_registry``) and
applies its own ``parallelize_llama``: FSDP2 with bf16 parameters and fp32 reduction,
per-block ``torch.compile``, no activation checkpointing. The benchmark drives both sides
with the same loop (synthetic tokens, AdamW, one optimizer step per micro-batch), so what
differs is the model code and the parallel wrappers: torchtitan's vs ``TrainEngine``
with ``model.kind: llama``, ``parallel.zero: 3``, ``train.dtype: bf16``,
``train.compile: true`` at the same shape.

Output: per side the median tokens/s (and min..max over ``--repeats`` runs, each
``--steps`` steps after ``--warmup``), peak memory (``torch.cuda.max_memory_allocated`` on
GPU, peak RSS on CPU) and MFU (``6N + 12·L·d·T`` FLOPs per token over the device's bf16
peak, ``--peak-tflops``, default H100 SXM dense 989), and the ratio ours / torchtitan.

    torchrun --nproc-per-node 8 benchmarks/engine_vs_torchtitan.py --flavor 8B --seq 8192 --batch 1
    python -m benchmarks.engine_vs_torchtitan --flavor debugmodel --device cpu   # CPU path

Each side runs in its own spawned process group (``--nproc`` ranks) when not under torchrun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torchtitan flavor -> our LlamaConfig at the same shape (torchtitan's debugmodel: dim 256,
# 6 layers, 16 heads, no GQA, vocab 2048, multiple_of 256).
SHAPES = {
    "debugmodel": dict(n_layers=6, d_model=256, n_heads=16, n_kv_heads=16, vocab_size=2048, multiple_of=256),
    "8B": dict(size="llama3-8b"),
    "70B": dict(size="llama3-70b"),
}


def our_side(args, device: torch.device):
    from elastic.engine import TrainEngine
    from elastic.models.config import LlamaConfig
    from elastic.optim import TrainConfig
    from elastic.parallel.config import ParallelConfig
    from elastic.parallel.dims import ParallelDims

    world = dist.get_world_size()
    cfg = LlamaConfig(**SHAPES[args.flavor], seq_len=args.seq)
    train = TrainConfig(
        steps=10**6,
        global_batch=args.batch * world,
        lr=3e-4,
        warmup_steps=0,
        grad_clip=1.0,
        dtype="bf16",
        compile=not args.no_compile,
    )
    engine = TrainEngine(
        cfg, ParallelConfig(zero=3, micro_batch=args.batch), train, ParallelDims.from_world(world), 0, device=device
    )

    def step(tokens: torch.Tensor) -> float:
        loss = engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
        engine.optimizer_step()
        return loss

    return step, cfg.flops_per_token(), cfg.vocab_size


def torchtitan_side(args, device: torch.device):
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry, parallelize_llama

    from elastic.models.config import LlamaConfig

    if device.type == "cpu" and args.patch_torchtitan_cpu:
        # torchtitan picks its device type once at import (`_get_available_device_type() or
        # "cuda"`) and builds its mesh on it, so on a CPU-only torch it fails in
        # `torch.cuda.set_device`. This opt-in patch points it at "cpu"; nothing else changes.
        import torchtitan.distributed.parallel_dims as tt_dims
        import torchtitan.tools.utils as tt_utils

        tt_utils.device_type, tt_dims.device_type = "cpu", "cpu"
    world = dist.get_world_size()
    spec = model_registry(args.flavor)  # its default attention: flex (sdpa is refused for LMs)
    parallelism = ParallelismConfig(data_parallel_shard_degree=world)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    compile_cfg = CompileConfig(enable=not args.no_compile, components=["model", "loss"])
    training = TrainingConfig(local_batch_size=args.batch, seq_len=args.seq, mixed_precision_param="bfloat16")
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_cfg,
        ac_config=None,
        dump_folder=tempfile.mkdtemp(),
    )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=None)
    model.train()
    # torchtitan's default AdamW settings (components/optimizer): lr 8e-4 in its configs; the
    # same hyperparameters as our side here, so only the implementation differs.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    ce = torch.nn.functional.cross_entropy

    def step(tokens: torch.Tensor) -> float:
        inputs = tokens[:, :-1]
        # As torchtitan's trainer does: per-token positions (one document per sequence) and
        # the flex-attention block mask built from them, every step.
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)
        masks = model.get_attention_masks(positions=positions)
        logits = model(inputs, positions=positions, attention_masks=masks)
        loss = ce(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    shape = SHAPES[args.flavor]
    ours = LlamaConfig(**shape, seq_len=args.seq)
    return step, ours.flops_per_token(), ours.vocab_size


def measure(side: str, args) -> dict:
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    step, flops_per_token, vocab = (our_side if side == "ours" else torchtitan_side)(args, device)
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen).to(device) for _ in range(4)]
    t_first = time.perf_counter()
    for i in range(args.warmup):
        step(batches[i % 4])
    warmup_s = time.perf_counter() - t_first
    _sync(device)
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % 4])
    _sync(device)
    elapsed = time.perf_counter() - t0
    tokens = args.batch * args.seq * args.steps * dist.get_world_size()
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "tokens_per_s": tokens / elapsed,
        "peak_mem_bytes": int(peak),
        "flops_per_token": flops_per_token,
        "warmup_s": warmup_s,
        "last_loss": loss,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _rank_main(rank: int, world: int, side: str, args, store: str, out: str) -> None:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    result = measure(side, args)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def run_side(side: str, args) -> dict:
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "result.json")
    mp.start_processes(
        _rank_main,
        args=(args.nproc, side, args, os.path.join(tmp, "store"), out),
        nprocs=args.nproc,
        join=True,
        start_method="spawn",
    )
    per_rank = json.load(open(out))
    return {
        "tokens_per_s": per_rank[0]["tokens_per_s"],
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in per_rank),
        "flops_per_token": per_rank[0]["flops_per_token"],
        "warmup_s": per_rank[0]["warmup_s"],
        "last_loss": per_rank[0]["last_loss"],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="debugmodel", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="steps before timing (includes compilation)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per-device dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--patch-torchtitan-cpu", action="store_true", help="make torchtitan build its mesh on CPU (it assumes CUDA)"
    )
    args = ap.parse_args(argv)

    results: dict[str, list[dict]] = {"torchtitan": [], "ours": []}
    for _ in range(args.repeats):  # interleaved, so that drift hits both sides alike
        for side in ("torchtitan", "ours"):
            results[side].append(run_side(side, args))
    print(
        f"flavor {args.flavor}, seq {args.seq}, batch {args.batch}/rank, {args.nproc} x {args.device}, bf16, "
        f"compile {'off' if args.no_compile else 'on'}, {args.steps} timed steps after {args.warmup}, "
        f"{args.repeats} repeats (median, min..max)"
    )
    summary = {}
    for side, runs in results.items():
        tps = [r["tokens_per_s"] for r in runs]
        mem = [r["peak_mem_bytes"] / 2**30 for r in runs]
        mfu = [t / args.nproc * r["flops_per_token"] / (args.peak_tflops * 1e12) for t, r in zip(tps, runs)]
        summary[side] = statistics.median(tps), statistics.median(mem)
        print(
            f"{side:>10}: {statistics.median(tps):12,.0f} tok/s ({min(tps):,.0f}..{max(tps):,.0f})  "
            f"peak mem {statistics.median(mem):7.2f} GiB ({min(mem):.2f}..{max(mem):.2f})  "
            f"MFU {100 * statistics.median(mfu):5.1f}%  warmup {statistics.median(r['warmup_s'] for r in runs):.1f} s"
        )
    ratio = summary["ours"][0] / summary["torchtitan"][0]
    mem_ratio = summary["ours"][1] / summary["torchtitan"][1]
    print(f"ratio ours/torchtitan: tokens/s {ratio:.3f} (goal >= 0.95), peak memory {mem_ratio:.3f} (goal <= 1.10)")


if __name__ == "__main__":
    main()
