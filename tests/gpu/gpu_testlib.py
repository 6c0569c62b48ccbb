"""Helpers of the ``gpu``-marked tests (one GPU, no Ray): a busy GPU on demand, tiny jobs.

These tests run on the GPU machine by ``make gpu-check`` (``benchmarks/gpu_check``), with
the device's own torch and no Ray; on CPU they are skipped.
"""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY_LLAMA = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16)


def sleep_cycles_per_second() -> float:
    """How many ``torch.cuda._sleep`` cycles keep this GPU busy for one second.

    The first launch of the kernel pays for its loading; timed then, the rate came out far
    too low on an H200 and "0.5 s" of work took a millisecond. So: warm up, then time two
    launches of ~0.1 s and keep the faster (the lower bound of the kernel's own time)."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    cycles, rates = 100_000_000, []
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / (start.elapsed_time(end) / 1000.0))
    return max(rates)


def busy_gpu(seconds: float, rate: float) -> None:
    """Queue about ``seconds`` of GPU work on the current stream; returns at once."""
    torch.cuda._sleep(int(seconds * rate))


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
