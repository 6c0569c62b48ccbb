"""GPU check, part ``snapshot``: the memory tier's CUDA -> pinned-CPU copy, as a fraction of a step.

Runs in its own process (``parts.py``). The worker's ``Trainer`` (``elastic/testing/
single_rank.py``, world-size-1 NCCL group) trains a ~210M-parameter Llama in bf16 with a
memory snapshot of its whole state (fp32 weights and AdamW moments, about 3.4 GB) after
every step, as ``checkpoint.memory_every_steps: 1`` does: a side stream copies it into
pinned host buffers while the next step computes, and the loop waits for the copy only
before its next optimizer step.

Two figures, in the same run on the same engine:

* the cost the trainer itself measures and reports (``SnapshotReport.blocking_s``: starting
  the copy, plus any wait for it before the next optimizer step) over the step's wall time;
  the goal is <= 1%;
* side by side: the median step time with snapshots and without (the period switched
  between phases, A B A B, the first step of each phase dropped), so that a cost the loop
  does not see (the copy slowing the compute) shows too.

The step is sized as jobs train (a global batch of 64 x 1024 tokens, micro-batch 8); the
copy's time and bandwidth are reported next to the step's, because a step shorter than the
copy would make any snapshot period of 1 cost the difference.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.gpu_check.common import MID, TINY, corpus_dir, device_kind, job_dict, job_spec
from benchmarks.gpu_check.device import bf16_peak_flops

GOAL_FRACTION = 0.01
WARMUP_STEPS = 4  # three snapshots allocate the three pinned buffers, then they are reused
PHASE_STEPS = 5
DRY_PHASE_STEPS = 2


def run(rec: Any, dry_run: bool) -> None:
    import torch

    from elastic.testing.single_rank import SingleRank, run_steps, trainer_on

    device = device_kind(dry_run)
    shape, seq, mb, gb = (TINY, 32, 2, 2) if dry_run else (MID, 1024, 8, 64)
    spec = job_spec(job_dict(shape, seq, mb, gb, device=device, memory_every_steps=1, cache_dir=corpus_dir()))
    rec.figure("model", {**shape, "seq_len": seq, "micro_batch": mb, "global_batch": gb})
    rank = SingleRank(device)
    peak = bf16_peak_flops(torch.cuda.get_device_name(0)) if device == "cuda" else None
    with_s: list[float] = []
    without_s: list[float] = []
    blocking, copies = [], []
    with trainer_on(rank, spec, peak_flops=peak) as trainer:
        warm = run_steps(trainer, WARMUP_STEPS)
        rec.say(f"warm-up: {[round(w, 3) for w in warm.wall_s]} s per step")
        pinned = pinned_state(trainer)
        rec.figure("pinned_buffers", pinned)
        if device == "cuda":
            rec.goal("host_buffers_pinned", pinned["all_pinned"], "==", True, performance=False)
        for phase in ("with", "without", "with", "without"):
            trainer.spec.checkpoint.memory_every_steps = 1 if phase == "with" else 0
            times = run_steps(trainer, (DRY_PHASE_STEPS if dry_run else PHASE_STEPS) + 1)
            kept = times.wall_s[1:]  # the first step of a phase still settles the other's copy
            (with_s if phase == "with" else without_s).extend(kept)
            snaps = [r.snapshot for r in times.reports[1:] if r.snapshot is not None]
            if phase == "with":
                blocking += [s.blocking_s for s in snaps]
                copies += [(s.duration_s, s.bytes) for s in snaps]
            rec.say(f"{phase} snapshots: median step {statistics.median(kept):.4f} s")
        trainer.spec.checkpoint.memory_every_steps = 1
    rank.close()
    step_with, step_without = statistics.median(with_s), statistics.median(without_s)
    copy_s = statistics.median(c for c, _ in copies) if copies else None
    nbytes = copies[0][1] if copies else None
    fraction = statistics.mean(blocking) / statistics.mean(with_s) if blocking else None
    rec.figure(
        "result",
        {
            "step_s_with_snapshots": round(step_with, 5),
            "step_s_without": round(step_without, 5),
            "overhead_fraction_side_by_side": round(step_with / step_without - 1, 5),
            "blocking_s_mean": round(statistics.mean(blocking), 6) if blocking else None,
            "blocking_s_max": round(max(blocking), 6) if blocking else None,
            "blocking_fraction": round(fraction, 6) if fraction is not None else None,
            "copy_s_median": round(copy_s, 5) if copy_s else None,
            "snapshot_bytes": nbytes,
            "copy_gb_per_s": round(nbytes / copy_s / 1e9, 2) if copy_s else None,
            "copy_over_step": round(copy_s / step_without, 4) if copy_s else None,
            "snapshots_measured": len(blocking),
        },
    )
    rec.goal("snapshot_blocking_fraction_of_step", fraction, "<=", GOAL_FRACTION)


def pinned_state(trainer: Any) -> dict[str, Any]:
    """Are the tier's host buffers pinned (on CUDA), and how many are there?"""
    snap = trainer.tier.newest()
    tensors = list(snap.tensors.values()) if snap is not None else []
    local = [getattr(t, "local", t) for t in tensors]
    return {
        "buffers": len(trainer.tier._own) + len(trainer.tier._free),
        "all_pinned": bool(local) and all(t.is_pinned() for t in local),
    }
