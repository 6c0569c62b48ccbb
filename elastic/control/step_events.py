"""The fields of the ``step`` and memory ``checkpoint`` events of a committed step
(``docs/outputs.md``), from every rank's ``StepReport``. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic.messages import StepReport

if TYPE_CHECKING:
    from elastic.spec import JobSpec


def step_fields(spec: JobSpec, dp: int, step: int, results: dict[int, StepReport]) -> dict[str, Any]:
    """The ``step`` event: the loss and grad norm every rank agrees on (rank 0's), the
    slowest rank's times, tokens/s over the global batch."""
    r0 = results[min(results)]
    tp, pp = spec.parallel.tp, spec.parallel.pp
    step_time = max(r.step_time_s for r in results.values())
    tokens = spec.train.global_batch * spec.model.seq_len
    fields: dict[str, Any] = dict(
        step=step,
        loss=r0.loss,
        dp=dp,
        tp=tp,
        pp=pp,
        grad_accum=spec.grad_accum(dp),
        world_size=dp * spec.parallel.replica_size,
        step_time_s=step_time,
        tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
        peak_mem_bytes=max(r.peak_mem_bytes for r in results.values()),
        grad_norm=r0.grad_norm,  # pre-clip global gradient norm (identical on every rank)
        data_wait_s=max(r.data_wait_s for r in results.values()),
        compute_s=max(r.compute_s for r in results.values()),
    )
    if r0.mfu is not None:
        fields["mfu"] = r0.mfu
    return fields


def memory_checkpoint_fields(results: dict[int, StepReport]) -> dict[str, Any] | None:
    """The memory-tier ``checkpoint`` event of the snapshots taken with this step, if any."""
    snaps = [r.snapshot for r in results.values() if r.snapshot is not None]
    if not snaps:
        return None
    return dict(
        step=snaps[0].step,
        tier="memory",
        blocking_s=max(s.blocking_s for s in snaps),
        duration_s=max(s.duration_s for s in snaps),
        bytes=sum(s.bytes for s in snaps),
    )
