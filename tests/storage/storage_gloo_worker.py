"""Body of the multi-process gloo test (importable by spawned children).

Four ranks hold real DTensors. They save with the runtime's recipe (``cpu_snapshot``: DTensor -> ShardRecord
on CPU, collective-free ``write_rank_shard``; only gathering the plain-data results
for the commit uses the process group), then load into other meshes and placements. Every
rank checks ``full_tensor()`` against the full tensors built from the same seed.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from elastic.testing.ranks import init_group
from storage import CheckpointStore, commit_checkpoint, cpu_snapshot, load_into, write_rank_shard


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {"w": torch.randn(10, 6, generator=g), "b": torch.randn(8, generator=g), "e": torch.randn(6, 4, generator=g)}


def _save(store: CheckpointStore, step: int, state: dict, rank: int, rank_local=()):
    """The runtime's recipe: CPU snapshot, collective-free upload, commit of gathered results."""
    snapshot, owned = cpu_snapshot(state, rank, rank_local=rank_local)
    result = write_rank_shard(store, step, snapshot, rank, owns=owned.__contains__)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)  # test transport only; the runtime uses Ray
    if rank == 0:
        commit_checkpoint(store, step, gathered, extra={"world": len(gathered)})
    dist.barrier()
    return result


def _check(tag: str, got: dict, want: dict) -> None:
    for k, v in want.items():
        value = got[k].full_tensor() if hasattr(got[k], "full_tensor") else got[k]
        assert torch.equal(value, v), f"{tag}: {k} differs"


def run(rank: int, world: int, out: str, root: str) -> None:
    init_group(rank, world, os.path.join(out, "store"))
    try:
        full = full_state()
        store = CheckpointStore(root)
        mesh1 = init_device_mesh("cpu", (world,))
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "fsdp"))

        # A: FSDP-like dp=4, Shard(0); rank-specific objects are named per rank
        saved = {k: distribute_tensor(v, mesh1, [Shard(0)]) for k, v in full.items()}
        rng = f"rng.rank{rank}"
        _save(store, 1, {**saved, "train.step": 7, rng: {"cpu": torch.get_rng_state()}}, rank, rank_local=[rng])

        # load A into HSDP-like [Replicate, Shard(0)] on a 2x2 mesh
        hsdp = {k: distribute_tensor(torch.zeros_like(v), mesh2, [Replicate(), Shard(0)]) for k, v in full.items()}
        out = load_into(store, hsdp, step=1)
        _check("A->hsdp", hsdp, full)
        assert out.objects["train.step"] == 7 and set(out.objects) == {"train.step"} | {
            f"rng.rank{r}" for r in range(world)
        }
        # load A into Shard on the last dim (a TP-like column split, uneven for w)
        cols = {k: distribute_tensor(torch.zeros_like(v), mesh1, [Shard(v.dim() - 1)]) for k, v in full.items()}
        load_into(store, cols, step=1)
        _check("A->cols", cols, full)

        # B: save from the HSDP layout, one replica writes; load into plain full tensors
        res = _save(store, 2, {**hsdp, "train.step": 8}, rank)
        if mesh2.get_coordinate()[0] == 1:
            assert res.files == [] and res.chunks == [], "replica 1 must not write"
        plain = {k: torch.zeros_like(v) for k, v in full.items()}
        out = load_into(store, plain, step=2)
        _check("B->plain", plain, full)
        assert out.objects == {"train.step": 8}
        # Every rank done before any tears its connections down: a rank still reading when a
        # peer's gloo pairs closed once aborted in C++ ("terminate called without an active
        # exception", 1 in about 6 suite runs).
        dist.barrier()
    finally:
        dist.destroy_process_group()
