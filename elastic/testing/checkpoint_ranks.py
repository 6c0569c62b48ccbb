"""Bodies of the multi-process gloo checkpoint tests and of ``benchmarks/restore_waves.py``
(importable by the spawned rank processes they run in).

Real ``TrainEngine``s on a gloo CPU mesh, saved through the storage tier's own classes
(``MemoryTier`` snapshot, ``StorageUploader``, ``CheckpointCommitter``) and restored through
``restore.py``. Each rank returns what it saw (``run_ranks`` pickles it) for the caller to check.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.committer import CheckpointCommitter
from elastic.checkpoint.memory_tier import MemoryTier
from elastic.checkpoint.restore import load_from_storage, load_snapshots_into
from elastic.checkpoint.storage_tier import StorageUploader, walk_state
from elastic.engine import TrainEngine
from elastic.events import EventLog
from elastic.messages import UploadReport
from elastic.parallel.dims import ParallelDims
from elastic.spec import JobSpec
from elastic.testing.ranks import init_group

GLOBAL, MICRO, STEPS = 8, 2, 3


def make_spec(zero: int, uri: str, train: dict | None = None) -> JobSpec:
    """``train``: keys over the default ``train`` section (``optimizer``, ``schedule``)."""
    return JobSpec.from_dict(
        {
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
            "parallel": {"micro_batch": MICRO, "zero": zero},
            "elastic": {"min_dp": 1, "max_dp": 2},
            "train": {"steps": 20, "global_batch": GLOBAL, "lr": 1e-2, "warmup_steps": 6, **(train or {})},
            "checkpoint": {"uri": uri, "every_steps": 1, "async": False},
        }
    )


def micro_batches(step: int, dp: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 64, (GLOBAL, 17), generator=torch.Generator().manual_seed(1000 + step))
    per = GLOBAL // dp
    return [
        (tokens[i : i + MICRO, :-1], tokens[i : i + MICRO, 1:])
        for i in range(dp_rank * per, (dp_rank + 1) * per, MICRO)
    ]


def build(spec: JobSpec, dp: int) -> TrainEngine:
    return TrainEngine(spec.model, spec.parallel, spec.train, ParallelDims(dp=dp, tp=1, pp=1, world_size=dp), spec.seed)


def train(engine: TrainEngine, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        losses.append(engine.forward_backward(micro_batches(step, engine.dims.dp, engine.coords.dp_rank)))
        engine.optimizer_step()
    return losses


def full_state(engine: TrainEngine) -> dict:
    """Every tensor as a full tensor (a collective under FSDP), plus lr and scheduler position."""
    out = {}
    for path, value in walk_state({"app": engine.state_dict()}):
        if isinstance(value, torch.Tensor):
            out[path] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    out["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
    out["last_epoch"] = engine.scheduler.last_epoch
    return out


def diff(want: dict, got: dict) -> list[str]:
    bad = sorted(set(want) ^ set(got))
    for k in set(want) & set(got):
        a, b = want[k], got[k]
        if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b):
            bad.append(k)
    return bad


def staggered_restore(
    rank: int, world: int, out: str, root: str, zero: int, waves: int = 1, max_reads: int = 0, hosts: int = 0
) -> dict:
    """dp=world: save step 3 through the storage tier, restore it into fresh engines from
    storage (in ``waves`` over ``hosts`` pretend hosts, ranks spread round-robin, when set)."""
    init_group(rank, world, os.path.join(out, "store"))
    try:
        spec = make_spec(zero, root)
        engine = build(spec, world)
        train(engine, 0, STEPS)
        gathered = save_and_commit(spec, engine, rank, world, root, out, STEPS, {"dp": world})
        want = full_state(engine)
        restored = build(spec, world)
        host = f"host{rank % hosts}" if hosts else None
        dist.barrier()
        t0 = time.time()
        objects, stats = load_from_storage(restored, STEPS, root, {}, waves, max_reads, host)
        stats["window"] = (t0, time.time())
        got = full_state(restored)
        next_losses = (train(engine, STEPS, 1)[0], train(restored, STEPS, 1)[0])
        return {
            "stats": stats,
            "diff": diff(want, got),
            "step": objects["train/step"],
            "batch_index": objects["train/batch_index"],
            "losses": next_losses,
            "upload": gathered[rank],
        }
    finally:
        dist.destroy_process_group()


def reshard_memory(rank: int, world: int, out: str, train_keys: dict | None = None) -> dict | None:
    """FSDP (zero 3) dp=2 memory snapshots of step 3, loaded by a dp=1 engine on rank 0
    (``train_keys``: over the spec's ``train`` section, e.g. another optimizer)."""
    init_group(rank, world, os.path.join(out, "store"))
    spec = make_spec(3, "unused", train_keys)
    engine = build(spec, world)
    train(engine, 0, STEPS)
    tier = MemoryTier()
    tier.snapshot_async(STEPS, rank, {"app": engine.state_dict(), "train": {"step": STEPS}}, {"dp": world, "zero": 3})
    tier.wait()
    snaps: list = [None] * world
    dist.all_gather_object(snaps, tier.get(rank, STEPS))
    want = full_state(engine)
    loss_dp2 = train(engine, STEPS, 1)[0]
    dist.destroy_process_group()
    if rank != 0:
        return None
    init_group(0, 1, os.path.join(out, "store_dp1"))
    try:
        single = build(spec, 1)
        load_snapshots_into(single, dict(enumerate(snaps)))
        got = full_state(single)
        return {
            "diff": diff(want, got),
            "sharded": [type(v).__name__ for v in snaps[1].tensors.values()][:1],
            "losses": (loss_dp2, train(single, STEPS, 1)[0]),
            "lr": got["lr"],
            "want_lr": want["lr"],
            "optimizer": type(single.optimizer).__name__,
            "state_keys": sorted({k.rsplit("/", 1)[-1] for k in got if "/optim/state/" in k}),
        }
    finally:
        dist.destroy_process_group()


def roundtrip_memory(rank: int, world: int, out: str, train_keys: dict) -> dict:
    """A DDP memory snapshot of step 3 loaded into a fresh engine of the same layout."""
    init_group(rank, world, os.path.join(out, "store"))
    try:
        spec = make_spec(0, "unused", train_keys)
        engine = build(spec, world)
        train(engine, 0, STEPS)
        tier = MemoryTier()
        tier.snapshot_async(STEPS, rank, {"app": engine.state_dict(), "train": {"step": STEPS}}, {"dp": world})
        tier.wait()
        want = full_state(engine)
        restored = build(spec, world)
        load_snapshots_into(restored, {rank: tier.get(rank, STEPS)})
        got = full_state(restored)
        return {
            "diff": diff(want, got),
            "lr": (want["lr"], got["lr"]),
            "losses": (train(engine, STEPS, 1), train(restored, STEPS, 1)),
        }
    finally:
        dist.destroy_process_group()


def _ep_cp_train(engine: TrainEngine, start: int, steps: int) -> list[float]:
    """Each data shard (dp x ep) its samples, each CP rank its chunk of every sequence."""
    dims, coords = engine.dims, engine.coords
    chunk = 16 // dims.cp
    lo = coords.cp_rank * chunk
    losses = []
    for step in range(start, start + steps):
        micro = micro_batches(step, dims.data_shards, dims.data_shard(coords))
        losses.append(engine.forward_backward([(x[:, lo : lo + chunk], y[:, lo : lo + chunk]) for x, y in micro]))
        engine.optimizer_step()
    return losses


def storage_roundtrip_ep_cp(rank: int, world: int, out: str, root: str, zero: int, ep: int, cp: int) -> dict:
    """A MoE Llama at dp x ep x cp = world: save step 3 through the storage tier (every rank
    writes what it owns), restore it from storage into fresh engines of the same layout."""
    init_group(rank, world, os.path.join(out, "store"))
    try:
        dp = world // (ep * cp)
        raw = make_spec(zero, root).model_dump(by_alias=True)
        raw["model"] = {"kind": "llama", "size": "tiny", "moe": {"n_experts": 4, "top_k": 2, "shared_expert": True}}
        raw["parallel"].update(ep=ep, cp=cp)
        raw["elastic"].update(max_dp=dp)
        spec = JobSpec.from_dict(raw)
        dims = ParallelDims(dp=dp, tp=1, pp=1, world_size=world, ep=ep, cp=cp)
        engine = TrainEngine(spec.model, spec.parallel, spec.train, dims, spec.seed)
        _ep_cp_train(engine, 0, STEPS)
        save_and_commit(spec, engine, rank, world, root, out, STEPS, {"dp": dp})
        want = full_state(engine)
        restored = TrainEngine(
            spec.model, spec.parallel, spec.train, ParallelDims(dp=dp, tp=1, pp=1, world_size=world, ep=ep, cp=cp), 1
        )
        objects, stats = load_from_storage(restored, STEPS, root, {})
        got = full_state(restored)
        next_losses = (_ep_cp_train(engine, STEPS, 1)[0], _ep_cp_train(restored, STEPS, 1)[0])
        return {"stats": stats, "diff": diff(want, got), "step": objects["train/step"], "losses": next_losses}
    finally:
        dist.destroy_process_group()


def save_and_commit(
    spec: Any, engine: Any, rank: int, world: int, root: str, out: str, step: int, layout: dict[str, int]
) -> list:
    """Every rank uploads its state of ``step`` through the storage tier (snapshot ``layout``);
    rank 0 commits, as a run does. Returns every rank's upload report."""
    tier, results = MemoryTier(), collections.deque[UploadReport]()
    uploader = StorageUploader(spec, root, rank, engine.dims, tier, results, base_step=0)
    state = {"app": engine.state_dict(), "train": {"step": step, "batch_index": step}}
    uploader.save(step, state, tier.snapshot_async(step, rank, state, layout))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results[0])
    if rank == 0:
        committer = CheckpointCommitter(spec, root, EventLog(out))
        for r, res in enumerate(gathered):
            committer.add(r, res)
        assert committer.join(60)
    dist.barrier()
    return gathered
