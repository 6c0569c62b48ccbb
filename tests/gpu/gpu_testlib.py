"""Helpers of the ``gpu``-marked tests (one GPU, no Ray): a busy GPU on demand, tiny jobs.

These tests run on the GPU machine by ``make gpu-check`` (``benchmarks/gpu_check``), with
the device's own torch and no Ray; on CPU they are skipped.
"""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY_LLAMA = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16)


_BUSY_N = 4096  # fp32 matmuls of this size: ~2 ms each on an H100/H200, real work no clock can skip


def sleep_cycles_per_second() -> float:
    """How many units of ``busy_gpu`` work this GPU does in one second (one unit: a
    4096 x 4096 fp32 matmul).

    ``torch.cuda._sleep`` was used first: on the H200 (torch 2.11, CUDA 13) "0.5 s" of it,
    calibrated the same way, was gone in 2 ms when a snapshot followed it, while the same
    kernel did slow a forward pass. Matmuls are work the GPU has to do. Warm up (cuBLAS picks
    its kernel), then time two batches of 20 and keep the faster."""
    a, out = _busy_operands()
    for _ in range(3):
        torch.mm(a, a, out=out)
    torch.cuda.synchronize()
    rates = []
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            torch.mm(a, a, out=out)
        end.record()
        end.synchronize()
        rates.append(20 / (start.elapsed_time(end) / 1000.0))
    return max(rates)


def _busy_operands() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(_BUSY_N, _BUSY_N, device="cuda", generator=gen) / _BUSY_N**0.5
    return a, torch.empty_like(a)


def busy_gpu(seconds: float, rate: float) -> None:
    """Queue about ``seconds`` of GPU work on the current stream; returns at once."""
    a, out = _busy_operands()
    for _ in range(max(1, int(seconds * rate))):
        torch.mm(a, a, out=out)


def tiny_job(tmp_path, **overrides):
    """A one-rank CUDA job spec of a tiny Llama (``jobs.JobSpec``)."""
    from jobs import JobSpec

    raw = {
        "name": "gpu-test",
        "model": {"kind": "llama", **TINY_LLAMA, "seq_len": 32},
        "data": {"num_samples": 64, "loader": "native", "stagger_s": 0.0, "cache_dir": str(tmp_path / "data")},
        "parallel": {"micro_batch": 2},
        "elastic": {"min_dp": 1, "max_dp": 1},
        "resources": {"device": "cuda", "gpus_per_worker": 1},
        "train": {"steps": 20, "global_batch": 4, "warmup_steps": 0},
        "checkpoint": {"every_steps": 0, "memory_every_steps": 1},
    }
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        raw[section][name] = value
    return JobSpec.from_dict(raw)
