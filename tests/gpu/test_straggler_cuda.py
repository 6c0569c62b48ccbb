"""Straggler timing on the GPU: a rank's own compute (``StepReport.compute_s``, what
``elastic.control.health.StragglerDetector`` compares) must grow when the rank is slower, whether
the slowness is on the host (the ``slow`` fault's busy loop) or on the device itself (a slow
or throttled GPU: here, extra queued GPU work in every forward pass)."""

from __future__ import annotations

import statistics

import pytest
from gpu_testlib import busy_gpu, needs_cuda, sleep_cycles_per_second, tiny_job

from elastic.control.health import StragglerDetector

pytestmark = [pytest.mark.gpu, pytest.mark.cluster, needs_cuda, pytest.mark.timeout(180)]  # cluster: NCCL groups

DELAY_S = 0.25
STEPS = 3


def _steps(tmp_path, slow_down) -> tuple[list, list]:
    """Own compute and step times of ``STEPS`` steps, before and after ``slow_down(engine)``."""
    from elastic.testing.single_rank import SingleRank, release_device_memory, run_steps, trainer_on

    rank = SingleRank("cuda")
    try:
        with trainer_on(rank, tiny_job(tmp_path, **{"checkpoint.memory_every_steps": 0})) as trainer:
            run_steps(trainer, 2)  # warm-up: kernels, allocator, optimizer state
            before = run_steps(trainer, STEPS).reports
            slow_down(trainer.engine)
            after = run_steps(trainer, STEPS).reports
    finally:
        rank.close()
        release_device_memory()
    return before, after


def _median(reports, field: str) -> float:
    return statistics.median(getattr(r, field) for r in reports)


def _gpu_slow_forward(engine) -> None:
    rate = sleep_cycles_per_second()
    engine.module.register_forward_pre_hook(lambda module, args: busy_gpu(DELAY_S, rate))


def test_a_host_side_straggler_shows_in_own_compute_on_cuda(tmp_path):
    from elastic.faults import _slow_forward

    before, after = _steps(tmp_path, lambda engine: _slow_forward(engine, DELAY_S))
    grown = _median(after, "compute_s") - _median(before, "compute_s")
    assert grown >= 0.8 * DELAY_S, f"own compute grew {grown:.3f} s for a {DELAY_S} s slower host"
    detector = StragglerDetector(factor=1.3, steps=2)
    found = [detector.feed({0: a.compute_s, 1: b.compute_s}) for a, b in zip(after, before)]
    assert found[1] is not None and found[1].ranks == [0]


def test_a_slow_gpu_lengthens_the_step(tmp_path):
    before, after = _steps(tmp_path, _gpu_slow_forward)
    grown = _median(after, "step_time_s") - _median(before, "step_time_s")
    assert grown >= 0.8 * DELAY_S, f"the step grew {grown:.3f} s for {DELAY_S} s of extra GPU work"


def test_a_slow_gpu_shows_in_own_compute(tmp_path):
    before, after = _steps(tmp_path, _gpu_slow_forward)
    grown = _median(after, "compute_s") - _median(before, "compute_s")
    assert grown >= 0.8 * DELAY_S, f"own compute grew {grown:.3f} s for {DELAY_S} s of extra GPU work"
