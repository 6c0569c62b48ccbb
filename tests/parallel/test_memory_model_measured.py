"""The memory model against measurement: predicted and measured per-rank peak agree within
+-15% for every layout of ``benchmarks/parallel_layouts.py`` (same code, same model, same
batch: ``elastic/testing/layout_memory.py``).

The measured peak is the live-tensor tracker's (a CPU stand-in for
``torch.cuda.max_memory_allocated``; deterministic: it counts tensor bytes, not time).
Four gloo ranks spawned on this machine, one engine per layout, two warm-up steps each.
"""

from __future__ import annotations

import pytest

from elastic.testing.layout_memory import DEFAULT_MICRO_BATCH, DEFAULT_MODEL, LAYOUTS, peak_vs_prediction, run_layouts

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

TOLERANCE = 0.15


def test_predicted_peak_within_15_percent_for_every_benchmark_layout():
    per_rank = run_layouts(LAYOUTS, DEFAULT_MODEL, world=4)
    ratios = {}
    for layout in LAYOUTS:
        measured, est, ratio = peak_vs_prediction(layout, per_rank, DEFAULT_MODEL, DEFAULT_MICRO_BATCH)
        ratios[layout.name] = ratio
        print(
            f"{layout.name:<19} measured {measured / 2**20:7.2f} MiB  predicted {est.total / 2**20:7.2f} MiB  "
            f"measured/predicted {ratio:.3f}"
        )
    off = {name: round(r, 3) for name, r in ratios.items() if abs(r - 1) > TOLERANCE}
    assert not off, f"measured/predicted peak outside 1 +- {TOLERANCE}: {off} (all: {ratios})"
