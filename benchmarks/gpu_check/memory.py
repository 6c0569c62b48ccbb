"""GPU check, part ``memory``: the memory model against ``torch.cuda.max_memory_allocated``.

Runs in its own process (``parts.py``). For each single-GPU layout (micro-batch, recompute,
sequence length) of a ~210M-parameter Llama in bf16 (``common.MID``), the job's engine
(``TrainEngine`` on a world-size-1 NCCL group) takes one step (which also creates the AdamW
state), then the peak is reset and a second step measured: its ``max_memory_allocated``
less what was allocated before the engine was built. The prediction is
``elastic.parallel.memory_model.estimate_for_spec`` for the same job spec, as ``elastic plan`` and
the sweep compute it. Goal: measured / predicted within 1 +- 0.15 for every layout.

In the dry run (CPU, fp32, tiny model) the measured figure is the engine's own live-tensor
probe (``elastic/parallel/memtrack.py``), the CPU stand-in the sweep uses.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu_check.common import MID, TINY, corpus_dir, device_kind, job_dict, job_spec
from benchmarks.gpu_check.device import sync

TOLERANCE = 0.15
# (micro_batch, recompute, seq_len)
LAYOUTS = ((4, False, 1024), (8, False, 1024), (8, True, 1024), (16, True, 1024), (2, False, 4096), (4, True, 4096))
DRY_LAYOUTS = ((2, False, 32), (2, True, 64))
PROBE_STEP = 2  # the step measured: the optimizer state exists from step 1 on


def run(rec: Any, dry_run: bool) -> None:
    from elastic.parallel.memory_model import estimate_for_spec
    from elastic.testing.single_rank import SingleRank, release_device_memory

    shape, layouts = (TINY, DRY_LAYOUTS) if dry_run else (MID, LAYOUTS)
    device = device_kind(dry_run)
    rank = SingleRank(device)
    dims = rank.join()
    data = corpus_dir()
    rec.figure("model", shape)
    results: dict[str, Any] = {}
    worst = 0.0
    for mb, recompute, seq in layouts:
        name = f"mb{mb}{'-ac' if recompute else ''}-seq{seq}"
        spec = job_spec(job_dict(shape, seq, mb, mb, device=device, recompute=recompute, cache_dir=data))
        est = estimate_for_spec(spec, 1, dtype_bytes=4)
        measured = measure_peak(spec, dims, rank.device)
        release_device_memory()
        ratio = measured / est.total
        worst = max(worst, abs(ratio - 1))
        results[name] = {
            "measured_bytes": measured,
            "predicted_bytes": est.total,
            "ratio": round(ratio, 4),
            "predicted": {
                k: getattr(est, k) for k in ("params", "grads", "optimizer", "buffers", "activations", "logits")
            },
        }
        rec.figure("layouts", results)
        rec.say(
            f"{name}: measured {measured / 2**30:.3f} GiB, predicted {est.total / 2**30:.3f} GiB, ratio {ratio:.3f}"
        )
    del dims
    rank.close()
    rec.figure("worst_abs_error", round(worst, 4))
    for name, r in results.items():
        rec.goal(f"{name}_measured_over_predicted", r["ratio"], "within", TOLERANCE)


def measure_peak(spec: Any, dims: Any, device: torch.device) -> int:
    """Peak bytes of the engine's second step (CUDA allocator peak, or the CPU probe)."""
    from elastic.engine import TrainEngine
    from elastic.tune.trial import ProbedParallel

    parallel = ProbedParallel(**spec.parallel.model_dump(), memory_probe_step=PROBE_STEP)
    sync(device)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    engine = TrainEngine(spec.model, parallel, spec.train, dims, spec.seed, device=device)
    gen = torch.Generator().manual_seed(0)
    mb, seq, vocab = spec.parallel.micro_batch, spec.model.seq_len, spec.model.vocab_size
    for step in range(1, PROBE_STEP + 1):
        tokens = torch.randint(0, vocab, (mb, seq + 1), generator=gen).to(device)
        batch = [(tokens[:, :-1], tokens[:, 1:])]
        if step == PROBE_STEP and device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats()
        engine.forward_backward(batch)
        engine.optimizer_step()
        del tokens, batch
    sync(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() - before
    return engine.peak_mem_bytes()  # the probed step's live tensor bytes
