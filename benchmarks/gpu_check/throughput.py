"""GPU check, part ``throughput``: our engine against a plain PyTorch loop on one GPU.

Runs in its own process (``parts.py``). Both sides train the same Llama (``elastic/models/
llama.py``, about 1.2B parameters at the Llama 3.2 1B shape, untied head: 1.5B stored) on
the same batch and sequence length, in bf16 with ``torch.compile`` on every transformer
block (regional compilation: one graph serves all blocks, so compiling is short):

* ours: ``TrainEngine`` (``elastic/parallel/``) on a world-size-1 NCCL group, at the
  single-GPU layout a job gets (``zero: 0``: no wrapper; bf16 autocast over fp32 weights,
  gradients and AdamW state; clipping to the global norm; its LR schedule);
* the baseline: the same module class, what a careful user writes by hand and what
  torchtitan does on one GPU: bf16 autocast, ``clip_grad_norm_`` and a fused AdamW.
  torchtitan itself is not installed on the device (``benchmarks/engine_vs_torchtitan.py``
  runs it where it is).

The sides run one after the other in this process, each after the other's memory is freed;
the second reuses the first's compiled graphs (same code, same shapes), and neither's
warm-up is timed. Figures per side: tokens/s (median of per-step rates and over the whole
timed window), MFU against the device's dense bf16 peak (``device.py``), peak memory, build
and warm-up time, and a split of one step into forward+backward and optimizer. Goal:
ours / baseline >= 0.95 in tokens/s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_check.device import bf16_peak_flops, peak_memory_reset, sync, total_memory_bytes

# The Llama 3.2 1B shape (Meta's model card: 16 layers, dim 2048, 32 heads, 8 KV heads,
# SwiGLU 8192, vocab 128256); our Llama does not tie the head to the embedding.
LLAMA_1B = dict(
    n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, vocab_size=128_256, multiple_of=256, ffn_dim_multiplier=1.5
)
TINY = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16)
GOAL_RATIO = 0.95


def settings(dry_run: bool) -> dict[str, Any]:
    if dry_run:
        return dict(shape=TINY, seq=32, batch=2, warmup=1, steps=2, split_steps=1, compile=False, device="cpu")
    return dict(shape=LLAMA_1B, seq=2048, batch=4, warmup=3, steps=15, split_steps=2, compile=True, device="cuda")


def run(rec: Any, dry_run: bool) -> None:
    from elastic.models.config import LlamaConfig
    from elastic.testing.single_rank import SingleRank, release_device_memory, worker_error

    s = settings(dry_run)
    cfg = LlamaConfig(**s["shape"], seq_len=s["seq"])
    s["batch"] = fitting_batch(cfg, s["batch"], s["device"])
    rank = SingleRank(s["device"])
    name = torch.cuda.get_device_name(0) if rank.device.type == "cuda" else "cpu"
    n_params = cfg.n_layers * cfg.block_params() + 2 * cfg.vocab_size * cfg.d_model
    rec.figure(
        "model", {**s["shape"], "seq_len": s["seq"], "params": n_params, "flops_per_token": cfg.flops_per_token()}
    )
    rec.figure("settings", {k: v for k, v in s.items() if k != "shape"} | {"dtype": dtype_of(rank.device)})
    rec.figure("peak_flops", bf16_peak_flops(name))
    rec.say(f"Llama {n_params / 1e9:.2f}B params, seq {s['seq']}, batch {s['batch']}, compile {s['compile']}, {name}")
    batches = make_batches(cfg, s["batch"], s["seq"], rank.device)
    error = None
    try:
        sides = measure_sides(rank, cfg, s, batches, rec, bf16_peak_flops(name))
    except Exception as exc:  # a compile that fails on this device: still measure both sides eager
        if not s["compile"]:
            raise
        error = worker_error(exc)
    if error is not None:
        rank.leave()
        release_device_memory()
        rec.figure("compile_error", error)
        rec.say(f"compiled run failed ({error}); measuring both sides without torch.compile")
        s["compile"] = False
        sides = measure_sides(rank, cfg, s, batches, rec, bf16_peak_flops(name), prefix="eager_")
    rank.close()
    ratio = sides["ours"]["tokens_per_s"] / sides["baseline"]["tokens_per_s"]
    rec.figure("ratio_tokens_per_s", round(ratio, 4))
    if error is not None:
        rec.goal("compiled_run", False, "==", True, performance=False)
    rec.goal("ours_over_baseline_tokens_per_s", ratio, ">=", GOAL_RATIO)


def measure_sides(
    rank: Any, cfg: Any, s: dict, batches: list, rec: Any, peak: float | None, prefix: str = ""
) -> dict[str, dict[str, Any]]:
    """Ours, then the baseline, each freed before the next; their figures by side."""
    from elastic.testing.single_rank import release_device_memory

    cuda = rank.device.type == "cuda"
    sides: dict[str, dict[str, Any]] = {}
    for side in ("ours", "baseline"):
        rec.say(f"{side}: build")
        t0 = time.perf_counter()
        peak_memory_reset(rank.device)
        if side == "ours":
            step, split = engine_side(rank, cfg, s, rank.device)
        else:
            step, split = plain_side(cfg, s, rank.device)
        build_s = time.perf_counter() - t0
        figures = measure(step, split, batches, s, rec, side)
        figures["build_s"] = round(build_s, 2)
        figures["mfu"] = figures["tokens_per_s"] * cfg.flops_per_token() / peak if peak else None
        figures["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
        sides[side] = figures
        rec.figure(prefix + side, figures)
        rec.say(
            f"{side}: {figures['tokens_per_s']:,.0f} tok/s, MFU {figures['mfu'] or 0:.3f}, "
            f"build {build_s:.1f} s, warm-up {figures['warmup_s']:.1f} s, peak {figures['peak_mem_gib']} GiB"
        )
        del step, split
        if side == "ours":
            rank.leave()
        release_device_memory()
        if cuda:
            rec.figure(f"{prefix}{side}_left_allocated_gib", round(torch.cuda.memory_allocated() / 2**30, 3))
    return sides


def fitting_batch(cfg: Any, batch: int, device: str) -> int:
    """Halve the batch until the memory model says a step fits in 85% of the device."""
    from elastic.parallel.memory_model import estimate_memory

    capacity = total_memory_bytes(device)
    while capacity and batch > 1:
        est = estimate_memory(cfg, micro_batch=batch, dtype_bytes=4, compute_dtype_bytes=2, num_microbatches=1)
        if est.total <= 0.85 * capacity:
            break
        batch //= 2
    return batch


def dtype_of(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


def make_batches(cfg: Any, batch: int, seq: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(4):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


Step = Callable[[torch.Tensor, torch.Tensor], float]
Split = Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]


def engine_side(rank: Any, cfg: Any, s: dict, device: torch.device) -> tuple[Step, Split]:
    from elastic.engine import TrainEngine
    from elastic.optim import TrainConfig
    from elastic.parallel.config import ParallelConfig

    train = TrainConfig(
        steps=10**6, global_batch=s["batch"], lr=3e-4, warmup_steps=0, grad_clip=1.0,
        dtype=dtype_of(device), compile=s["compile"],
    )  # fmt: skip
    engine = TrainEngine(cfg, ParallelConfig(micro_batch=s["batch"]), train, rank.join(), seed=0, device=device)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = engine.forward_backward([(x, y)])  # returns a float: the device is synchronised
        engine.optimizer_step()
        return loss

    def split(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        sync(device)
        t0 = time.perf_counter()
        engine.forward_backward([(x, y)])
        sync(device)
        t1 = time.perf_counter()
        engine.optimizer_step()
        sync(device)
        return t1 - t0, time.perf_counter() - t1

    return step, split


def plain_side(cfg: Any, s: dict, device: torch.device) -> tuple[Step, Split]:
    from elastic.models.llama import Llama
    from elastic.models.spec import lm_loss

    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device=device)
    init_on_device(model)
    if s["compile"]:
        for block in model.blocks.values():
            block.compile()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=cuda)

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = lm_loss(model(x), y)
        loss.backward()
        return loss

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=cuda)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = forward_backward(x, y)
        optimizer_step()
        return float(loss)  # as the engine does: one host sync per step, for the loss

    def split(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        sync(device)
        t0 = time.perf_counter()
        float(forward_backward(x, y))
        sync(device)
        t1 = time.perf_counter()
        optimizer_step()
        sync(device)
        return t1 - t0, time.perf_counter() - t1

    return step, split


@torch.no_grad()
def init_on_device(model: torch.nn.Module) -> None:
    """Norm weights 1, everything else N(0, 0.02), drawn on the device (the values do not
    change a step's speed; drawing 1.5B numbers on the host would take a minute)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def measure(step: Step, split: Split, batches: list, s: dict, rec: Any, side: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    for i in range(s["warmup"]):
        loss = step(*batches[i % len(batches)])
        rec.say(f"{side}: warm-up step {i + 1}/{s['warmup']} loss {loss:.3f} at {time.perf_counter() - t0:.1f} s")
    sync(batches[0][0].device)
    warmup_s = time.perf_counter() - t0
    tokens = s["batch"] * s["seq"]
    per_step: list[float] = []
    t_start = time.perf_counter()
    last = t_start
    for i in range(s["steps"]):
        loss = step(*batches[i % len(batches)])
        now = time.perf_counter()
        per_step.append(now - last)
        last = now
    sync(batches[0][0].device)
    elapsed = time.perf_counter() - t_start
    splits = [split(*batches[i % len(batches)]) for i in range(s["split_steps"])]
    return {
        "tokens_per_s": tokens * s["steps"] / elapsed,
        "tokens_per_s_median_step": tokens / statistics.median(per_step),
        "step_s_median": round(statistics.median(per_step), 5),
        "step_s_min": round(min(per_step), 5),
        "step_s_max": round(max(per_step), 5),
        "timed_steps": s["steps"],
        "warmup_s": round(warmup_s, 2),
        "last_loss": round(loss, 4),
        "fwd_bwd_s": round(min(f for f, _ in splits), 5),
        "optimizer_s": round(min(o for _, o in splits), 5),
    }
