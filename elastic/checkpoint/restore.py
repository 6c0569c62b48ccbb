"""Restoring a worker's state from memory-tier snapshots or from the storage tier.

Every path fills a state dict shaped by the *new* engine (``engine.state_dict()``: DTensors
of the new mesh where sharded) and hands it to ``engine.load_state_dict``, so any saved
layout loads into any new one: DCP's planner reshards (``storage.load_into``), whether the
boxes come from peers' snapshots (``SnapshotReader``) or from storage (``CheckpointReader``).

Two pieces of state are never taken from a checkpoint, because they describe the *new*
run rather than the trained model: the optimizer's ``param_groups`` (they name each pipeline
stage's own parameters, so they are not even saved) and the scheduler's ``base_lrs`` (the
configured ``train.lr``). The learning rate is then recomputed from the restored scheduler
position with the current schedule: exactly what a fault-free run has at that step.

Staggered restore from storage: replicated state is read by DP rank 0 of each (pp, tp)
coordinate only, and broadcast over the DP group of the freshly built mesh, so storage
serves the state once (1x), not once per replica. DP-sharded state (FSDP) is read by its
owner, again once in total. With ``data.waves`` or ``data.max_reads_per_host``, the reading
ranks also read in rounds by host (``load_from_storage``), so storage is not stampeded.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.memory_tier import Snapshot, unflatten_state
from elastic.checkpoint.storage_tier import open_store, scrub, walk_state
from elastic.ingest.rounds import read_rounds
from storage import CheckpointReader, SnapshotReader, load_into, redact_uri
from storage.errors import LayoutMismatch
from storage.records import ShardRecord

log = logging.getLogger(__name__)

APP = "app"
FROM_TARGET = ("app/optim/param_groups", "app/scheduler/base_lrs")
BATCH_BYTES = 64 << 20  # replicated state is read and broadcast in batches of this size


def load_snapshots_into(engine: Any, snaps: dict[int, Snapshot]) -> None:
    """Load the engine's state from snapshots of the old layout (own or peers').

    Snapshots of fully replicated state (DDP) load directly. Sharded snapshots (FSDP, TP,
    PP, or a different layout) go through DCP's load planner, which reshards them into
    the engine's current layout.
    """
    first = next(iter(snaps.values()))
    sharded = any(isinstance(v, ShardRecord) for s in snaps.values() for v in s.tensors.values())
    if len(snaps) == 1 and not sharded:
        # Clone: the optimizer would otherwise alias the snapshot buffers, which the
        # memory tier reuses for later snapshots (and AdamW bumps ``step`` in place).
        flat = {k: v.clone() for k, v in first.tensors.items() if k.startswith(APP + "/")}
        flat.update({k: copy.deepcopy(v) for k, v in first.objects.items() if k.startswith(APP + "/")})
        engine.load_state_dict(app_state(flat))
        sync_lr(engine)
        return
    _load_resharded(engine, list(snaps.values()))


def load_live_into(engine: Any, live: Any, objects: dict[str, Any]) -> None:
    """Load a survivor's own live state (``elastic.parallel.live.LiveState``: its local shards
    of the same tensors in the new layout) into ``engine``: the parameter shards are copied
    into the new wrapper's (unless the build took them as its storage: ``adopt_shards``),
    the optimizer state is taken over without a copy (wrapped as DTensors of the new mesh),
    and the LR schedule's position comes from ``objects``, the plain values of the rank's
    own snapshot of the same step."""
    from torch.distributed.tensor import DTensor

    from elastic.parallel.live import dtensor_like

    for name, param in engine.model.named_parameters():
        kept, local = live.params.get(name), _local(param)
        if kept is None or kept.shape != local.shape:
            raise LayoutMismatch(f"{name}: the live state does not hold this rank's shard")
        if local.data_ptr() != kept.data_ptr():  # not already its storage (``adopt_shards``)
            with torch.no_grad():
                local.copy_(kept)
        state = live.optim.get(name)
        if state:
            engine.optimizer.state[param] = {
                k: dtensor_like(v, param) if isinstance(param, DTensor) and torch.is_tensor(v) and v.dim() > 0 else v
                for k, v in state.items()
            }
    prefix = f"{APP}/scheduler/"
    flat = {k.removeprefix(f"{APP}/"): copy.deepcopy(v) for k, v in objects.items() if k.startswith(prefix)}
    scheduler = unflatten_state(flat).get("scheduler", {})
    scheduler["base_lrs"] = engine.scheduler.base_lrs  # the configured train.lr (see the module doc)
    engine.scheduler.load_state_dict(scheduler)
    sync_lr(engine)
    engine._sd_cache = None


def _load_resharded(engine: Any, snaps: list[Snapshot]) -> None:
    tensors, target_objects = flat_target(engine)
    load_into(SnapshotReader({s.rank: s.tensors for s in snaps}), tensors)
    objects: dict[str, Any] = {}
    for s in snaps:  # per-parameter optimizer objects differ per pipeline stage: take the union
        for k, v in s.objects.items():
            objects.setdefault(k, v)
    finish_load(engine, tensors, target_objects, objects)


def flat_target(engine: Any, scalars_are_tensors: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The new engine's state as ``(tensors, objects)`` by snapshot path; DTensors kept.

    0-d tensors (AdamW's ``step``) are objects in memory snapshots but tensors in storage
    (``write_rank_shard`` stores every tensor as one): ``scalars_are_tensors`` picks.
    """
    from torch.distributed.tensor import DTensor

    tensors, objects = {}, {}
    for path, value in walk_state({APP: engine.state_dict()}):
        if isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and (value.dim() > 0 or scalars_are_tensors)):
            tensors[path] = value
        else:
            objects[path] = value
    return tensors, objects


def finish_load(engine: Any, tensors: dict[str, Any], target_objects: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Load filled ``tensors`` plus the saved objects (see the module docstring) into ``engine``."""
    flat = dict(tensors)
    for path, value in target_objects.items():
        if path in FROM_TARGET:
            flat[path] = value
        elif path in loaded:
            flat[path] = copy.deepcopy(loaded[path])
        else:
            raise LayoutMismatch(f"{path}: not in the checkpoint")
    engine.load_state_dict(app_state(flat))
    sync_lr(engine)


def app_state(flat: dict[str, Any]) -> dict:
    """The engine's state from flat snapshot paths. An optimizer that keeps no per-parameter
    state (SGD without momentum) saves an empty ``state``, which flattening drops; DCP would
    read its absence as another format, so it is put back."""
    state = unflatten_state(flat)[APP]
    state.setdefault("optim", {}).setdefault("state", {})
    return state


def sync_lr(engine: Any) -> None:
    """Set every param group's lr from the restored scheduler position and current schedule."""
    sched = engine.scheduler
    lambdas = getattr(sched, "lr_lambdas", None)
    if lambdas is None:
        return
    lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, lambdas)]
    for group, lr in zip(engine.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs


# ----------------------------------------------------------------------------- storage


class _TensorReader(CheckpointReader):
    """Tensors only: the plain objects are fetched once, by one rank, then broadcast."""

    def read_objects(self) -> dict[str, Any]:
        return {}


def _replicated_over_dp(value: Any) -> bool:
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor):
        return True  # plain tensors are never sharded over DP
    from elastic.parallel.dims import spans_dp

    names = value.device_mesh.mesh_dim_names or ()
    # spans_dp: "dp" and the flattened dp_ep_cp / dp_cp; HSDP's two DP dimensions by name
    hsdp = ("dp_replicate", "dp_shard")
    return all(isinstance(p, Replicate) for n, p in zip(names, value.placements) if spans_dp(n) or n in hsdp)


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _opened(reader: Any | None) -> Any:
    """The reader of a rank that reads (the leader, or an owner of DP-sharded state)."""
    if reader is None:
        raise RuntimeError("restore: a rank with state to read opened no reader")
    return reader


def _batches(tensors: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{}]
    size = 0
    for path in sorted(tensors):
        t = _local(tensors[path])
        if out[-1] and size + t.numel() * t.element_size() > BATCH_BYTES:
            out.append({})
            size = 0
        out[-1][path] = tensors[path]
        size += t.numel() * t.element_size()
    return [b for b in out if b]


def _broadcast(batch: dict[str, Any], group: Any, lead: bool) -> int:
    """Broadcast a batch of tensors from DP rank 0 (one flat buffer per dtype); returns bytes."""
    moved = 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for path in sorted(batch):
        t = _local(batch[path])
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, ts in by_dtype.items():
        if lead:
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
        else:
            flat = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=ts[0].device)
        dist.broadcast(flat, group=group, group_src=0)
        if not lead:
            offset = 0
            for t in ts:
                t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        moved += flat.numel() * flat.element_size()
    return moved


def load_from_storage(
    engine: Any,
    step: int,
    uri: str,
    storage_options: dict[str, Any] | None,
    waves: int = 1,
    max_reads_per_host: int = 0,
    host: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Staggered restore of checkpoint ``step`` under ``uri`` into ``engine``.

    Every rank of the new group calls this at the same time (it broadcasts over DP).
    ``waves`` and ``max_reads_per_host`` (``data.waves``, ``data.max_reads_per_host``; 0: no
    cap) stagger the reading ranks by host, like the data reads (docs/data.md): then every
    reader reads all it needs in its round, the rounds separated by barriers of the whole
    group, and the DP broadcasts follow. ``host`` names this rank's host (default: its Ray
    node, or the machine's name). Returns the checkpoint's plain objects and what this rank
    moved: ``bytes_read`` from storage, ``broadcast_bytes`` received from its DP leader.
    """
    store = open_store(uri, storage_options)
    tensors, target_objects = flat_target(engine, scalars_are_tensors=True)
    objects, stats = read_staggered(
        engine,
        tensors,
        lambda: _TensorReader(store, step),
        waves,
        max_reads_per_host,
        host,
        read_objects=CheckpointReader.read_objects,
    )
    finish_load(engine, tensors, target_objects, objects)
    stats["step"] = step
    log.info(
        "restored step %d from %s: read %d bytes from storage (%d tensor data), %d bytes by DP broadcast, %.2fs",
        step,
        redact_uri(uri),
        stats["bytes_read"],
        stats["data_bytes_read"],
        stats["broadcast_bytes"],
        stats["duration_s"],
    )
    return objects, stats


def read_staggered(
    engine: Any,
    tensors: dict[str, Any],
    open_reader: Callable[[], Any],
    waves: int = 1,
    max_reads_per_host: int = 0,
    host: str | None = None,
    read_objects: Callable[[Any], Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Fill ``tensors`` (the engine's targets by path) from ``open_reader()``, once per DP group.

    Replicated state is read by DP rank 0 and broadcast, DP-sharded state by its owner, in
    host rounds when ``waves``/``max_reads_per_host`` ask for them (see ``load_from_storage``,
    which reads checkpoints through it; ``model.init_from`` reads Hugging Face weights the
    same way). ``read_objects(reader)`` gives the plain objects, read once by the DP leader
    and broadcast. Returns those objects and the read's statistics.
    """
    t0 = time.perf_counter()
    group = engine.dims.dp_mesh.get_group() if engine.dims.dp > 1 else None
    lead = engine.coords.dp_rank == 0
    shared = {k: v for k, v in tensors.items() if group is not None and _replicated_over_dp(v)}
    own = {k: v for k, v in tensors.items() if k not in shared}
    my_round, rounds = _my_round(lead or bool(own), waves, max_reads_per_host, host)
    stats: dict[str, Any] = {"read_round": my_round, "read_rounds": rounds}
    reader, objects, received = None, None, 0

    def lead_objects() -> Any:
        return read_objects(reader) if lead and read_objects is not None else None

    if rounds > 1:  # staggered: read everything in this rank's round, then broadcast
        for r in range(rounds):
            if r == my_round:
                stats["read_started_at"] = time.time()
                reader = open_reader()
                objects = lead_objects()
                if lead and shared:
                    load_into(reader, shared)
                if own:
                    load_into(reader, own)
                stats["read_ended_at"] = time.time()
            dist.barrier()
        objects = _broadcast_objects(objects, group) if read_objects is not None else None
        for batch in _batches(shared):
            moved = _broadcast(batch, group, lead)
            received += 0 if lead else moved
    else:
        reader = open_reader() if lead or own else None
        objects = _broadcast_objects(lead_objects(), group) if read_objects is not None else None
        for batch in _batches(shared):  # the leader reads a batch while the others wait for it
            if lead:
                load_into(_opened(reader), batch)
            moved = _broadcast(batch, group, lead)
            received += 0 if lead else moved
        if own:
            load_into(_opened(reader), own)
    stats.update(
        bytes_read=reader.bytes_read if reader else 0,
        data_bytes_read=reader.data_bytes_read if reader else 0,
        broadcast_bytes=received,
        duration_s=time.perf_counter() - t0,
    )
    return objects, stats


def _broadcast_objects(objects: Any, group: Any) -> Any:
    if group is None:
        return objects
    box = [objects]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _my_round(reads: bool, waves: int, max_reads_per_host: int, host: str | None) -> tuple[int | None, int]:
    """This rank's read round and the number of rounds (``elastic.ingest.rounds``); one
    round, and no collective, when nothing is staggered."""
    if (waves <= 1 and max_reads_per_host <= 0) or not dist.is_initialized() or dist.get_world_size() == 1:
        return (0 if reads else None), 1
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (host or _host_name()) if reads else None)
    rounds, n = read_rounds(everyone, waves, max_reads_per_host)
    return rounds[dist.get_rank()], n


def _host_name() -> str:
    """This process's Ray node (the test clusters' nodes share one machine), else the machine."""
    import socket
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return socket.gethostname()


def latest_storage_step(spec: Any, uri: str) -> int | None:
    """Newest committed checkpoint under ``uri`` whose files all verify, or None.

    Damaged checkpoints are skipped with a warning naming their bad files (by the store).
    """
    if not uri:
        return None
    try:
        info = open_store(uri, spec.checkpoint.storage_options).latest_valid(verify=True)
    except Exception as exc:  # noqa: BLE001 - unreadable storage means "nothing to resume from"
        log.warning(
            "cannot read checkpoints under %s: %s",
            redact_uri(uri),
            scrub(f"{type(exc).__name__}: {exc}", spec.checkpoint.storage_options),
        )
        return None
    return None if info is None else info.step
