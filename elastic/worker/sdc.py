"""Silent data corruption, the workers' side (docs/health.md).

Every ``elastic.sdc_check_every`` steps, after the optimizer step, each rank takes an exact
fingerprint of its parameters (a CRC-32 of their bytes on CPU; on an accelerator an
integer sum of their words, computed where they live), and the ranks all-gather them: one
collective of one integer per rank. Ranks that must hold bitwise-identical parameters
(DP twins: the same TP/PP shard) are compared; ``elastic.worker.sdc_vote.vote`` names the odd ones.

Every rank sees the same fingerprints, so every rank reaches the same verdict without a
word from the controller. On a pass, the step's memory snapshot (forced at check steps) is
protected in the tier until the next pass: it is the newest verified state. On a mismatch
every rank rolls back to it in place (weights, optimizer, schedule, data cursor, RNG) and
reports an ``SdcReport``; training then replays the same samples as a fault-free run.
A corrupted rank has sent corrupted gradients to every replica since the flip, so only
such a rollback, not a copy from a healthy twin, repairs the state.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch
import torch.distributed as dist

from elastic.worker.rng import capture_rng, restore_rng
from elastic.worker.sdc_vote import SdcVerdict, sdc_due, twin_groups, vote

_MASK = (1 << 64) - 1


def fingerprint(params: list[torch.Tensor]) -> int:
    """An exact fingerprint of ``params``' bytes: any single flipped bit changes it."""
    locals_ = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in params]
    if all(t.device.type == "cpu" for t in locals_):
        crc = 0
        for t in locals_:
            crc = zlib.crc32(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()), crc)
        return crc
    return word_sum_fingerprint(locals_)


def word_sum_fingerprint(tensors: list[torch.Tensor]) -> int:
    """The accelerator's fingerprint, computed where the tensors live (any device).

    A wrapping 64-bit sum of each tensor's words, mixed across tensors by distinct odd
    multipliers (a bijection mod 2**64, so one flipped bit always shows). Integer sums are
    exact in any order, so a device and the CPU agree on it.
    """
    sums = []
    for t in tensors:
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        pad = (-flat.numel()) % 8
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        elif flat.storage_offset() % 8:  # a view that starts mid-word cannot be read as int64 in place
            flat = flat.clone()
        sums.append(flat.view(torch.int64).sum())
    acc = 0
    for i, v in enumerate(torch.stack(sums).tolist()):
        acc = (acc + (v & _MASK) * (2 * i + 1)) & _MASK
    return acc - (1 << 64) if acc >= 1 << 63 else acc


class SdcGuard:
    """One generation's SDC checks on one rank (a new trainer makes a new guard)."""

    def __init__(self, spec: Any, dims: Any, rank: int, tier: Any):
        self.every, self.last_step = spec.elastic.sdc_check_every, spec.train.steps
        self.dims, self.rank, self.tier = dims, rank, tier
        self.verified: int | None = None  # the protected snapshot's step
        self.check_s = 0.0  # the last check's cost (fingerprint and all-gather)
        self.initial: dict[str, Any] | None = None  # a fresh start's state (see ``baseline``)

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def due(self, step: int) -> bool:
        return sdc_due(step, self.every, self.last_step)

    def baseline(self, trainer: Any) -> None:
        """Before a generation's first step: its starting state is the first verified one
        (replicas start identical: seeded, or restored from one consistent state).

        A fresh start is kept apart from the tier: before the first optimizer step the
        optimizer has no state, and building a state dict of it would initialise that
        state (a zero-gradient step), changing the run. The weights, learning rates, LR
        schedule and RNG are copied instead; rolling back to them restarts the optimizer empty.
        """
        if not self.enabled or self.verified is not None:
            return
        engine = trainer.engine
        if trainer.step == 0 and not engine.optimizer.state:
            self.initial = {
                "params": [p.detach().clone() for p in engine.model.parameters()],
                "lrs": [g["lr"] for g in engine.optimizer.param_groups],
                "scheduler": engine.scheduler.state_dict(),
                "rng": capture_rng(),
            }
            self.verified = 0
            return
        trainer.snapshot_now()
        self.passed(trainer.step)

    def restore_initial(self, engine: Any) -> None:
        """Back to the fresh start of the run (see ``baseline``)."""
        init = self.initial
        with torch.no_grad():
            for p, saved in zip(engine.model.parameters(), init["params"]):
                (p.to_local() if hasattr(p, "to_local") else p).copy_(
                    saved.to_local() if hasattr(saved, "to_local") else saved
                )
        engine.optimizer.state.clear()
        for g, lr in zip(engine.optimizer.param_groups, init["lrs"]):
            g["lr"] = lr
        engine.scheduler.load_state_dict(init["scheduler"])
        engine._sd_cache = None
        restore_rng(init["rng"])

    def passed(self, step: int) -> None:
        self.verified, self.initial = step, None
        self.tier.protect(step)

    def check(self, engine: Any) -> SdcVerdict:
        """Fingerprint, all-gather, vote. The copies in flight (own snapshot, peer replica)
        finish first, so that after the collective no pre-rollback copy is still travelling."""
        t0 = time.perf_counter()
        self.tier.wait()
        self.tier.wait_replication()
        mine = fingerprint([p for p in engine.model.parameters()])
        device = engine.device
        local = torch.tensor([mine], dtype=torch.int64, device=device)
        world = self.dims.world_size
        gathered = [torch.empty_like(local) for _ in range(world)]
        if world > 1:
            dist.all_gather(gathered, local)
        else:
            gathered = [local]
        fps = [int(t.item()) for t in gathered]
        # Ranks that hold the same parameters (zero 0): one (pp, tp, ep) coordinate, over DP and CP.
        coords = [(c.pp_rank, c.tp_rank, c.ep_rank) for c in map(self.dims.coords, range(world))]
        self.check_s = time.perf_counter() - t0
        return vote(fps, twin_groups(coords))

    def odd_replica(self, verdict: SdcVerdict) -> int | None:
        if not verdict.decided:
            return None
        replicas = {self.dims.coords(r).dp_rank for r in verdict.odd}
        return replicas.pop() if len(replicas) == 1 else None
