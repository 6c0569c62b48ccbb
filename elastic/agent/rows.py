"""Step reports as columns (pure): many ranks' ``StepReport``s of a step become one
``StepRows`` (``elastic/messages.py``) at the agent, blocks of one step merge at each
aggregator, and the driver reads a step's loss, times and stragglers from the columns."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from elastic.messages import StepReport, StepRows

_FLOATS = ("loss", "grad_norm", "step_time_s", "data_wait_s", "compute_s", "done_at", "mfu")
_SNAP = ("snap_blocking_s", "snap_duration_s")
_INTS = ("ranks", "peak_mem_bytes", "snap_step", "snap_bytes")
COLUMNS = _INTS + _FLOATS + _SNAP


def rows_of(step: int, reports: Sequence[tuple[int, StepReport]]) -> StepRows:
    """One block from ``(rank, report)`` pairs, all of ``step``."""
    snaps = [r.snapshot for _, r in reports]
    cols: dict[str, Sequence[float]] = {
        "ranks": [rank for rank, _ in reports],
        "loss": [r.loss for _, r in reports],
        "grad_norm": [r.grad_norm for _, r in reports],
        "step_time_s": [r.step_time_s for _, r in reports],
        "data_wait_s": [r.data_wait_s for _, r in reports],
        "compute_s": [r.compute_s for _, r in reports],
        "peak_mem_bytes": [r.peak_mem_bytes for _, r in reports],
        "done_at": [r.done_at for _, r in reports],
        "mfu": [math.nan if r.mfu is None else r.mfu for _, r in reports],
        "snap_step": [-1 if s is None else s.step for s in snaps],
        "snap_blocking_s": [0.0 if s is None else s.blocking_s for s in snaps],
        "snap_duration_s": [0.0 if s is None else s.duration_s for s in snaps],
        "snap_bytes": [0 if s is None else s.bytes for s in snaps],
    }
    return StepRows(step=step, **{k: _array(k, v) for k, v in cols.items()})


def _array(name: str, values: Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64 if name in _INTS else np.float64)


def merge_rows(blocks: Iterable[StepRows]) -> list[StepRows]:
    """Blocks of the same step concatenated into one, in step order."""
    by_step: dict[int, list[StepRows]] = {}
    for b in blocks:
        by_step.setdefault(b.step, []).append(b)
    out = []
    for step in sorted(by_step):
        group = by_step[step]
        if len(group) == 1:
            out.append(group[0])
            continue
        out.append(StepRows(step=step, **{k: np.concatenate([getattr(b, k) for b in group]) for k in COLUMNS}))
    return out


def row_count(blocks: Iterable[StepRows]) -> int:
    return sum(len(b.ranks) for b in blocks)
