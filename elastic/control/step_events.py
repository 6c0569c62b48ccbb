"""The fields of the ``step`` and memory ``checkpoint`` events of a committed step
(``docs/outputs.md``), from every rank's step report, as columns (``StepRows``). Pure.

``StepTally`` gathers one step's rows as they come (from many agents, in blocks) and knows
when every rank of the layout is in; a rank reported twice (a replaced agent sends again)
counts once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from elastic.agent.rows import COLUMNS, merge_rows, rows_of
from elastic.messages import StepReport, StepRows
from elastic.models.config import token_shape

if TYPE_CHECKING:
    from elastic.spec import JobSpec


class StepTally:
    """One step's reports so far, for a layout of ``world`` ranks."""

    def __init__(self, step: int, world: int):
        self.step, self.world = step, world
        self.seen = np.zeros(max(world, 1), dtype=bool)
        self.count = 0
        self.blocks: list[StepRows] = []

    def add(self, rows: StepRows) -> None:
        ranks = rows.ranks
        keep = (ranks >= 0) & (ranks < self.world)
        keep[keep] = ~self.seen[ranks[keep]]
        if keep.any():
            _, first = np.unique(ranks[keep], return_index=True)  # a rank twice in one block counts once
            idx = np.flatnonzero(keep)[first]
            if len(idx) != len(ranks):
                rows = StepRows(step=rows.step, **{k: getattr(rows, k)[idx] for k in COLUMNS})
            self.seen[rows.ranks] = True
            self.count += len(rows.ranks)
            self.blocks.append(rows)

    def add_report(self, rank: int, report: StepReport) -> None:
        self.add(rows_of(report.step, [(rank, report)]))

    @property
    def complete(self) -> bool:
        return self.count >= self.world

    def rows(self) -> StepRows:
        merged = merge_rows(self.blocks)
        if not merged:
            return rows_of(self.step, [])
        return merged[0]


def step_fields(spec: JobSpec, dp: int, step: int, rows: StepRows) -> dict[str, Any]:
    """The ``step`` event: the loss and grad norm every rank agrees on (the lowest rank's),
    the slowest rank's times, tokens/s over the global batch."""
    r0 = int(np.argmin(rows.ranks))
    tp, pp = spec.parallel.tp, spec.parallel.pp
    step_time = float(rows.step_time_s.max())
    tokens = spec.train.global_batch * token_shape(spec.model)[0]
    fields: dict[str, Any] = dict(
        step=step,
        loss=float(rows.loss[r0]),
        dp=dp,
        tp=tp,
        pp=pp,
        grad_accum=spec.grad_accum(dp),
        world_size=dp * spec.parallel.replica_size,
        step_time_s=step_time,
        tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
        peak_mem_bytes=int(rows.peak_mem_bytes.max()),
        grad_norm=float(rows.grad_norm[r0]),  # pre-clip global gradient norm (identical on every rank)
        data_wait_s=float(rows.data_wait_s.max()),
        compute_s=float(rows.compute_s.max()),
    )
    mfu = float(rows.mfu[r0])
    if not math.isnan(mfu):
        fields["mfu"] = mfu
    return fields


def memory_checkpoint_fields(rows: StepRows) -> dict[str, Any] | None:
    """The memory-tier ``checkpoint`` event of the snapshots taken with this step, if any."""
    snaps = rows.snap_step >= 0
    if not snaps.any():
        return None
    return dict(
        step=int(rows.snap_step[snaps][0]),
        tier="memory",
        blocking_s=float(rows.snap_blocking_s[snaps].max()),
        duration_s=float(rows.snap_duration_s[snaps].max()),
        bytes=int(rows.snap_bytes[snaps].sum()),
    )
