"""Per-rank peak memory of parallel layouts, measured, next to the memory model's prediction.

Shared by ``benchmarks/parallel_layouts.py`` (which adds timing rounds and prints the table)
and ``tests/parallel/test_memory_model_measured.py`` (which asserts the prediction within +-15%).
``run_layouts`` spawns ``world`` ranks (gloo on 127.0.0.1, one torch thread per rank;
``device="cuda"`` uses NCCL, one GPU per rank); every layout trains the same GPT
(``build_model`` with the same seed) on the same global batch through ``TrainEngine``.
Per layout, one after another: build the engine, ``warmup`` steps (PP's first step also
probes shapes), then one *instrumented* step for memory (below); then optional timing
rounds (``rounds`` x ``steps_per_round`` interleaved steps per layout).

Memory, per rank, three figures:

* ``state``: exact bytes of the tensors this rank holds for its parameters (local shards
  of DTensors), its gradients (taken after the last backward of the step, before the
  optimizer step) and its optimizer state (after the step). Caveat: FSDP2 keeps
  parameters and gradients sharded *between* steps at every ZeRO level, so for ZeRO-1/2
  this end-of-step figure is below the in-step figure the memory model describes.
* ``peak`` (the headline): the peak of live tensor bytes during the instrumented step,
  a CPU stand-in for ``torch.cuda.max_memory_allocated``. A ``TorchDispatchMode`` sees
  the storage of every tensor an op returns (DTensors and other wrapper subclasses are
  flattened to their local tensors), ``UntypedStorage.resize_`` is wrapped (FSDP2 frees
  and re-allocates its unsharded parameters that way), and a weak reference per storage
  removes its bytes when it is freed. Parameters, buffers and optimizer state are
  registered when the step starts. The peak is sampled after every op and every resize,
  which is where memory grows. What it cannot see: memory allocated inside a kernel and
  freed before it returns (workspaces), buffers owned by C++ that no op ever returns to
  Python (classic DDP's reducer buckets are seen only once a bucket view is returned by
  an op; gloo's own staging buffers never), allocator overheads and fragmentation, and
  tensors that exist before the step but are first touched after the peak.
* ``rss_delta``: the process's peak resident set (``VmHWM`` from ``/proc/self/status``,
  reset by writing ``5`` to ``/proc/self/clear_refs`` after the engine is built) minus its
  resident set right before the engine was built (after ``gc.collect`` and
  ``malloc_trim``). Honest about everything the process holds, but noisy on CPU at this
  model size (glibc keeps freed heap, gloo allocates on first use, pages). Where
  ``clear_refs`` is not writable it falls back to ``ru_maxrss`` and says so.

On ``device="cuda"`` the ``peak`` is ``torch.cuda.max_memory_allocated`` (reset after the
warm-up) minus ``memory_allocated`` right before the engine was built: the exact figure,
which the CPU tracker only approximates.

The prediction (``predict``) is ``elastic.parallel.memory_model.estimate_memory`` at the layout's
tp/pp/dp/zero, micro-batch, recompute flag, fp32 state (``dtype_bytes=4``) and the run's
compute precision (``dtype``: fp32, or bf16 as autocast / FSDP's bf16 policy), the real number
of micro-batches per step and the PP schedule. It is the worst pipeline stage; the
measured figure is the worst rank. ``PipelineStage``'s receive buffers are registered with
the tracker (allocated by the first step, written in place by receives, they would
otherwise be invisible); classic DDP's reducer buckets are seen only once an op returns a
view of them, so DDP layouts read a little low on CPU.

Longer than the ~350 lines we aim for: a measurement harness (layouts, gloo ranks, peak
memory) used by one test and one benchmark, kept in one file.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import os
import re
import resource
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pydantic import TypeAdapter

from elastic.engine import TrainEngine
from elastic.models.config import AnyModelConfig, token_shape
from elastic.models.gpt import ModelConfig
from elastic.optim import TrainConfig
from elastic.parallel import pp
from elastic.parallel.config import ParallelConfig
from elastic.parallel.dims import ParallelDims
from elastic.parallel.memory_model import MemoryEstimate, estimate_memory
from elastic.parallel.memtrack import LiveTensorBytes, tensor_bytes
from elastic.parallel.memtrack import tensors_in as _tensors
from elastic.testing.ports import free_port as _free_port

# The benchmark's default model and batch: the test asserts on what the benchmark prints.
DEFAULT_MODEL = ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=512, seq_len=64)
DEFAULT_GLOBAL_BATCH = 16
DEFAULT_MICRO_BATCH = 2


@dataclass(frozen=True)
class Layout:
    name: str
    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    ac: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


LAYOUTS = [
    Layout("DP4", dp=4),
    Layout("DP2xTP2", dp=2, tp=2),
    Layout("DP2xPP2", dp=2, pp=2),
    Layout("TP2xPP2", dp=1, tp=2, pp=2),
    Layout("ZeRO-3xDP4", dp=4, zero=3),
    Layout("ZeRO-2+ACxDP2xTP2", dp=2, tp=2, zero=2, ac=True),
    Layout("ZeRO-1xDP4", dp=4, zero=1),
    Layout("TP2xPP2+AC", dp=1, tp=2, pp=2, ac=True),
]


# --------------------------------------------------------------------------- memory probes


_LIBC = None


def _malloc_trim() -> None:
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


class RssProbe:
    """Resident-set delta from a baseline taken before the engine is built."""

    def __init__(self):
        gc.collect()
        _malloc_trim()
        self.base_kib = _status_kib("VmRSS")
        self.method = "VmHWM-reset"

    def reset_peak(self) -> None:
        gc.collect()
        _malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "ru_maxrss(monotonic)"

    def delta_bytes(self) -> int | None:
        if self.base_kib is None:
            return None
        if self.method == "VmHWM-reset":
            peak = _status_kib("VmHWM")
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return None if peak is None else max(0, peak - self.base_kib) * 1024


# --------------------------------------------------------------------------- per rank


def make_batches(cfg: AnyModelConfig, global_batch: int, micro_batch: int, dp: int, dp_rank: int, step: int):
    """This DP rank's micro-batches of a deterministic random batch (the same for every layout)."""
    gen = torch.Generator().manual_seed(1000 + step)
    seq_len, vocab_size = token_shape(cfg)
    tokens = torch.randint(0, vocab_size, (global_batch, seq_len + 1), generator=gen)
    per_rank = global_batch // dp
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [
        (mine[i : i + micro_batch, :-1].contiguous(), mine[i : i + micro_batch, 1:].contiguous())
        for i in range(0, per_rank, micro_batch)
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def rank_main(rank: int, world: int, cfg: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    device_type = cfg["device"]
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    model_cfg = TypeAdapter(AnyModelConfig).validate_python(cfg["model"])
    train_cfg = TrainConfig(
        steps=10_000, global_batch=cfg["global_batch"], lr=1e-4, warmup_steps=1, dtype=cfg.get("dtype", "fp32")
    )
    layouts = [Layout(**d) for d in cfg["layouts"]]
    mb = cfg["micro_batch"]
    engines: dict[str, TrainEngine] = {}
    results: dict[str, dict] = {}
    step_no: dict[str, int] = {}

    def batches(layout: Layout, engine: TrainEngine):
        step = step_no[layout.name]
        step_no[layout.name] = step + 1
        return make_batches(model_cfg, cfg["global_batch"], mb, layout.dp, engine.coords.dp_rank, step)

    # ----- phase 1: build, warm up, one instrumented step, per layout --------------------
    for layout in layouts:
        pcfg = ParallelConfig(
            tp=layout.tp, pp=layout.pp, zero=layout.zero, micro_batch=mb, activation_checkpointing=layout.ac
        )
        dims = ParallelDims(dp=layout.dp, tp=layout.tp, pp=layout.pp, world_size=world)
        dist.barrier()
        rss = RssProbe()
        cuda_base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        engine = TrainEngine(model_cfg, pcfg, train_cfg, dims, seed=cfg["seed"], device=device)
        build_s = time.perf_counter() - t0
        rss.reset_peak()
        engines[layout.name], step_no[layout.name] = engine, 0
        for _ in range(cfg["warmup"]):
            engine.forward_backward(batches(layout, engine))
            engine.optimizer_step()
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        # The instrumented step.
        mbs = batches(layout, engine)
        gc.collect()
        tracker = LiveTensorBytes(device)
        with tracker:
            tracker.register(list(engine.model.parameters()) + list(engine.model.buffers()))
            tracker.register(_tensors(engine.optimizer.state))
            tracker.register([t for pair in mbs for t in pair])
            if engine.pipeline_stage is not None:  # kept from the first step, written in place by receives
                tracker.register(pp.received_buffers(engine.pipeline_stage))
            loss = engine.forward_backward(mbs)
            params = [p for p in engine.model.parameters()]
            params_b = tensor_bytes(params, device)
            grads_b = tensor_bytes([p.grad for p in params if p.grad is not None], device)
            engine.optimizer_step()
        _sync(device)
        optim_b = tensor_bytes(_tensors(engine.optimizer.state), device)
        peak = tracker.peak
        if device.type == "cuda":
            cuda_peak = int(torch.cuda.max_memory_allocated(device)) - cuda_base
        results[layout.name] = {
            "rank": rank,
            "coords": list(engine.coords),
            "grad_accum": engine.grad_accum,
            "bubble_fraction": engine.bubble_fraction,
            "build_s": build_s,
            "loss": loss,
            "state_bytes": {
                "params": params_b,
                "grads": grads_b,
                "optimizer": optim_b,
                "total": params_b + grads_b + optim_b,
            },
            "tracked_peak_bytes": peak,
            "cuda_peak_bytes": cuda_peak if device.type == "cuda" else None,
            "rss_delta_bytes": rss.delta_bytes(),
            "rss_method": rss.method,
            # The engine's own figure: process-lifetime ru_maxrss on CPU (absolute, monotonic
            # over all layouts of this process), max_memory_allocated on CUDA.
            "engine_peak_mem_bytes": engine.peak_mem_bytes(),
            "step_s": [],
        }

    # ----- phase 2: interleaved timing rounds --------------------------------------------
    for _ in range(cfg["rounds"]):
        for layout in layouts:
            engine = engines[layout.name]
            for _ in range(cfg["steps_per_round"]):
                mbs = batches(layout, engine)
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                engine.forward_backward(mbs)
                engine.optimizer_step()
                _sync(device)
                dt = time.perf_counter() - t0
                results[layout.name]["step_s"].append(_max_over_ranks(dt, device))

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def predict(
    layout: Layout, model_cfg: ModelConfig, micro_batch: int, grad_accum: int, dtype: str = "fp32"
) -> MemoryEstimate:
    """The memory model's figure for ``layout`` (fp32 state, ``dtype`` compute, the engine's 1F1B schedule)."""
    return estimate_memory(
        model_cfg,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        zero=layout.zero,
        micro_batch=micro_batch,
        activation_checkpointing=layout.ac,
        dtype_bytes=4,
        num_microbatches=grad_accum,
        pp_schedule="1f1b",
        compute_dtype_bytes=2 if dtype == "bf16" else None,
    )


def peak_key(device: str) -> str:
    return "cuda_peak_bytes" if device == "cuda" else "tracked_peak_bytes"


def run_layouts(
    layouts: list[Layout],
    model_cfg: ModelConfig = DEFAULT_MODEL,
    *,
    world: int = 4,
    device: str = "cpu",
    global_batch: int = DEFAULT_GLOBAL_BATCH,
    micro_batch: int = DEFAULT_MICRO_BATCH,
    warmup: int = 2,
    rounds: int = 0,
    steps_per_round: int = 0,
    seed: int = 0,
    dtype: str = "fp32",
) -> list[dict]:
    """Spawn ``world`` ranks that run ``rank_main``; returns each rank's results (by layout name)."""
    bad = [lay.name for lay in layouts if lay.world != world]
    if bad:
        raise ValueError(f"layouts {bad} need a world other than {world}")
    cfg = {
        "device": device,
        "port": _free_port(),
        "model": model_cfg.model_dump(),
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "warmup": warmup,
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "seed": seed,
        "dtype": dtype,
        "layouts": [asdict(lay) for lay in layouts],
    }
    with tempfile.TemporaryDirectory(prefix="parallel_layouts-") as out_dir:
        mp.start_processes(rank_main, args=(world, cfg, out_dir), nprocs=world, join=True, start_method="spawn")
        per_rank = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    return per_rank


def peak_vs_prediction(
    layout: Layout,
    per_rank: list[dict],
    model_cfg: ModelConfig,
    micro_batch: int,
    device: str = "cpu",
    dtype: str = "fp32",
) -> tuple[int, MemoryEstimate, float]:
    """(measured peak of the worst rank, the prediction, measured / predicted) for one layout."""
    ranks = [r[layout.name] for r in per_rank]
    measured = max(r[peak_key(device)] for r in ranks)
    est = predict(layout, model_cfg, micro_batch, ranks[0]["grad_accum"], dtype)
    return measured, est, measured / est.total
