"""GPU check, part ``sweep``: the sweep's trial body over micro-batch x recompute, without Tune.

Runs in its own process (``parts.py``), with no Ray. Each configuration is one trial as
``elastic/tune/trial.py`` makes it: ``build_trial_spec`` (the user's spec at this
configuration, ``trial_steps`` steps, no storage checkpoints), the memory model's prediction
(``estimate_for_spec``), the trial's metrics (``_Reporter``: tokens/s after the warm-up
steps, MFU, peak memory) and its status rule (``trial_status``). In place of the trial's
elastic job, the rank trains as a worker does (``elastic/testing/single_rank.py``: the
worker's ``Trainer`` on a world-size-1 NCCL group); an error is reported as the worker
reports it (``TypeName: message``) and the device is cleaned for the next trial, as a
worker leaves its group after an error.

One configuration is sized by the memory model to need 1.5x the device's memory: it must
end as ``oom`` (a real ``torch.OutOfMemoryError``), and the trial after it must run. In the
dry run (CPU) that trial's out-of-memory error is raised by a step hook instead. Memory
snapshots are off here (part ``snapshot`` measures them).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.gpu_check.common import MID, TINY, corpus_dir, device_kind, job_dict
from benchmarks.gpu_check.device import bf16_peak_flops, total_memory_bytes

TRIAL_STEPS, WARMUP_STEPS = 4, 2  # the sweep's own warm-up (elastic/tune/api.py)
GRID = ((4, False), (4, True), "oom", (8, False), (8, True), (16, False), (16, True))
DRY_GRID = ((2, False), "oom", (2, True))


class SimulatedOOM:
    """A step hook for the CPU dry run: the first step raises ``torch.OutOfMemoryError``."""

    def attach(self, stop: Any, beat: Any) -> None:
        pass

    def pending(self, step: int, rank: int) -> bool:
        return False

    def before_join(self, generation: int, rank: int) -> None:
        pass

    def before_step(self, step: int, rank: int, engine: Any) -> None:
        raise torch.OutOfMemoryError("simulated in the CPU dry run: CUDA out of memory. Tried to allocate 1 TiB")


def run(rec: Any, dry_run: bool) -> None:
    from elastic.testing.single_rank import SingleRank
    from jobs import JobSpec

    device = device_kind(dry_run)
    shape, seq, grid = (TINY, 32, DRY_GRID) if dry_run else (MID, 1024, GRID)
    global_batch = 16 if not dry_run else 4
    rank = SingleRank(device)
    peak = bf16_peak_flops(torch.cuda.get_device_name(0)) if device == "cuda" else None
    data = corpus_dir()
    base = job_dict(shape, seq, 1, global_batch, device=device, cache_dir=data)
    ctx = {"spec": base, "trial_steps": TRIAL_STEPS, "warmup_steps": WARMUP_STEPS, "device": device}
    ctx |= {"spec_cls": JobSpec, "corpus_cache": data}
    rec.figure("model", {**shape, "seq_len": seq, "global_batch": global_batch, "trial_steps": TRIAL_STEPS})
    trials: dict[str, Any] = {}
    for entry in grid:
        if entry == "oom":
            mb = oom_micro_batch(shape, seq, device) if not dry_run else 8
            trial_ctx = {**ctx, "spec": {**base, "train": {**base["train"], "global_batch": mb}}}
            config, hook = _config(mb, False), (SimulatedOOM() if dry_run else None)
        else:
            trial_ctx, config, hook = ctx, _config(*entry), None
        key, metrics = run_trial(rank, trial_ctx, config, peak, hook)
        metrics["expected"] = "oom" if entry == "oom" else "ok"
        trials[key] = metrics
        rec.figure("trials", trials)
        peak_gib, predicted_gib = (metrics["peak_mem_bytes"] or 0) / 2**30, metrics["predicted_mem_bytes"] / 2**30
        rec.say(
            f"{key}: {metrics['status']} {metrics['tokens_per_s']:,.0f} tok/s, peak {peak_gib:.2f} GiB, "
            f"predicted {predicted_gib:.2f} GiB{', ' + metrics['reason'][:160] if metrics['reason'] else ''}"
        )
    rank.close()
    ok = {k: t for k, t in trials.items() if t["status"] == "ok"}
    if ok:
        best = max(ok, key=lambda k: ok[k]["tokens_per_s"])
        rec.figure("best", {"config": best, "tokens_per_s": ok[best]["tokens_per_s"], "mfu": ok[best]["mfu"]})
    wrong = {k: t["status"] for k, t in trials.items() if t["status"] != t["expected"]}
    rec.figure("unexpected_status", wrong)
    rec.goal("trials_with_expected_status", len(trials) - len(wrong), "==", len(trials), performance=False)
    oom_keys = [k for k, t in trials.items() if t["expected"] == "oom"]
    rec.goal("oom_trial_recorded_as_oom", trials[oom_keys[0]]["status"], "==", "oom", performance=False)


def _config(micro_batch: int, recompute: bool) -> dict[str, Any]:
    return {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "micro_batch": micro_batch, "activation_checkpointing": recompute}


def oom_micro_batch(shape: dict[str, Any], seq: int, device: str) -> int:
    """The smallest power-of-two micro-batch the memory model puts at 1.5x the device."""
    from elastic.models.config import LlamaConfig
    from elastic.parallel.memory_model import estimate_memory

    cfg, capacity, mb = LlamaConfig(**shape, seq_len=seq), total_memory_bytes(device), 16
    while estimate_memory(cfg, micro_batch=mb, dtype_bytes=4, compute_dtype_bytes=2).total < 1.5 * capacity:
        mb *= 2
    return mb


def run_trial(rank: Any, ctx: dict, config: dict, peak: float | None, hook: Any) -> tuple[str, dict[str, Any]]:
    """One trial: spec, prediction, steps through the worker's Trainer, metrics and status."""
    from elastic.parallel.memory_model import estimate_for_spec
    from elastic.testing.single_rank import release_device_memory, run_steps, trainer_on, worker_error
    from elastic.tune.space import config_key
    from elastic.tune.trial import _Reporter, build_trial_spec, trial_status

    spec = build_trial_spec(ctx, config)
    reports: list[dict[str, Any]] = []
    reporter = _Reporter(ctx, config, estimate_for_spec(spec, 1, dtype_bytes=4).total, time.monotonic(), reports.append)
    error = None
    try:
        with trainer_on(rank, spec, peak_flops=peak, hook=hook) as trainer:
            while trainer.step < ctx["trial_steps"]:
                for report in run_steps(trainer, 1).reports:
                    reporter(step_event(report, spec))
    except Exception as exc:  # a failed trial is a result (as run_trial records it for Tune)
        error = worker_error(exc)
    release_device_memory()  # outside the except block: its traceback held the step's tensors
    if error is not None:
        reporter({"kind": "failure", "cause": "worker_error", "detail": error})
        reason = "; ".join(reporter.failures)
        reports.append(reporter.metrics(reporter.last_step, trial_status(reason), " ".join(reason.split())[:500]))
    metrics = reports[-1] if reports else reporter.metrics(0, "failed", "no step completed")
    return config_key(config), metrics


def step_event(report: Any, spec: Any) -> dict[str, Any]:
    """A ``step`` event as the controller writes it for a committed step (one rank)."""
    tokens = spec.train.global_batch * spec.model.seq_len
    return {
        "kind": "step",
        "step": report.step,
        "tokens_per_s": tokens / report.step_time_s if report.step_time_s > 0 else 0.0,
        "step_time_s": report.step_time_s,
        "peak_mem_bytes": report.peak_mem_bytes,
        "mfu": report.mfu,
    }
