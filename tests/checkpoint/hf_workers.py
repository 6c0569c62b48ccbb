"""Rank bodies of the multi-process Hugging Face round trip (importable by spawned ranks).

Per layout, on one gloo world: a real ``TrainEngine`` built from a spec with
``model.init_from``, loaded by ``load_init_from`` (the worker's path), its full weights
gathered for the test to compare, two training steps, and a checkpoint written through the
storage tier's own classes (``StorageUploader``, ``CheckpointCommitter``), which
``elastic ckpt export`` then reads.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from hf_testlib import STEPS, micro_batches, spec_raw
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from elastic.checkpoint.hf_import import load_init_from
from elastic.engine import TrainEngine
from elastic.parallel.dims import ParallelDims
from elastic.testing.checkpoint_ranks import save_and_commit
from elastic.testing.ranks import init_group
from jobs import JobSpec


def hf_layouts(rank: int, world: int, out: str, hf_dirs: dict[str, str], layouts: list[tuple]) -> dict:
    """For each ``(name, kind, parallel, waves)`` (any TP, PP, EP or HSDP that fits ``world``):
    load ``hf_dirs[kind]``, gather, train on this rank's data shard, save to ``out/<name>``."""
    init_group(rank, world, os.path.join(out, "store"))
    results = {}
    try:
        for name, kind, parallel, waves in layouts:
            spec = JobSpec.from_dict(spec_raw(hf_dirs[kind], os.path.join(out, name), parallel, waves))
            p = spec.parallel
            dp = world // (p.tp * p.pp * p.ep)
            dims = ParallelDims(dp=dp, tp=p.tp, pp=p.pp, world_size=world, ep=p.ep, shard_group=p.shard_group)
            engine = TrainEngine(spec.model, spec.parallel, spec.train, dims, spec.seed, restoring=True)
            host = f"host{rank % 2}"  # two pretend hosts, so that waves make rounds
            stats = load_init_from(engine, spec.model.init_from, waves, 0, host)
            full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True))
            weights = {k: v.detach().clone() for k, v in full.items()}
            losses = []
            for step in range(STEPS):
                shard = dims.data_shard(engine.coords)  # a (dp, ep) pair's slice of the batch
                mbs = micro_batches(step, dims.data_shards, shard, p.micro_batch)
                losses.append(engine.forward_backward(mbs))
                engine.optimizer_step()
            _save(spec, engine, rank, world, out, STEPS)
            results[name] = {"stats": stats, "weights": weights, "losses": losses, "coords": tuple(engine.coords)}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return results


def _save(spec: JobSpec, engine: TrainEngine, rank: int, world: int, out: str, step: int) -> None:
    """Write ``step`` through the storage tier and commit it (rank 0), as a run does."""
    layout = {"dp": engine.dims.dp, "tp": engine.dims.tp, "pp": engine.dims.pp, "zero": spec.parallel.zero}
    save_and_commit(spec, engine, rank, world, spec.checkpoint.uri, out, step, layout)
