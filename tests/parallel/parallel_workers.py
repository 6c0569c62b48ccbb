"""Per-rank bodies for the parallel engine tests (module level so spawn can import them)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from parallel_harness import MODEL, SEED, STEPS, TRAIN, Layout, dp_micro_batches, init_group
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from elastic.engine import TrainEngine
from elastic.models.spec import model_spec
from elastic.parallel.config import ParallelConfig
from elastic.parallel.dims import ParallelDims


class ProbedParallel(ParallelConfig):
    """A parallel config whose engine tracks the peak live tensor bytes of one step (elastic/parallel/memtrack.py)."""

    memory_probe_step: int | None = None


def make_engine(layout: Layout, world: int, model_cfg=MODEL, train=TRAIN, probe_step: int | None = None) -> TrainEngine:
    dims = ParallelDims(
        dp=layout.dp, tp=layout.tp, pp=layout.pp, world_size=world, ep=layout.ep, cp=layout.cp,
        shard_group=layout.shard_group,
    )  # fmt: skip
    pcfg = ProbedParallel(
        memory_probe_step=probe_step,
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
        cp=layout.cp,
        zero=layout.zero,
        shard_group=layout.shard_group,
        micro_batch=layout.micro_batch,
        activation_checkpointing=layout.ac,
        pp_schedule=layout.schedule,
    )
    return TrainEngine(model_cfg, pcfg, train, dims, SEED)


def train_steps(engine: TrainEngine, layout: Layout, steps: range) -> tuple[list[float], list[float]]:
    """Each data shard (a (dp, ep) pair) its slice of the batch; each CP rank its chunk of it."""
    shard, coords = engine.dims.data_shard(engine.coords), engine.coords
    losses, norms = [], []
    for step in steps:
        micro = dp_micro_batches(
            step,
            engine.dims.data_shards,
            shard,
            layout.micro_batch,
            cfg=engine.model_cfg,
            n=engine.train_cfg.global_batch,
        )
        chunk = micro[0][0].shape[1] // layout.cp
        lo = coords.cp_rank * chunk
        loss = engine.forward_backward([(x[:, lo : lo + chunk], y[:, lo : lo + chunk]) for x, y in micro])
        norms.append(engine.optimizer_step())
        losses.append(loss)
    return losses, norms


def initial_weight_diffs(engine: TrainEngine) -> dict[str, float]:
    """Max |full parameter - single-process seeded init| for each FQN this rank holds."""
    full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True))
    reference = model_spec(engine.model_cfg).build_full(SEED).state_dict()
    return {fqn: float((value.cpu() - reference[fqn]).abs().max()) for fqn, value in full.items()}


def param_placements(engine: TrainEngine) -> dict[str, str]:
    """How each parameter is held: 'tensor' or its DTensor placements, e.g. '(Shard(dim=0),)'."""
    return {
        fqn.removeprefix("module."): str(getattr(p, "placements", "tensor"))
        for fqn, p in engine.model.named_parameters()
    }


def count_block_forwards(engine: TrainEngine) -> list[int]:
    """Count the MLP forwards of this rank's first block; recompute starts it twice.

    A pre-hook: checkpoint's early stop may end the recomputation inside the MLP, before
    a post-hook would fire.
    """
    calls = [0]
    block = next(iter(engine.gpt.blocks.values()))
    block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def state_dict_matches_fresh(engine: TrainEngine) -> tuple[bool, bool]:
    """Does the (possibly cached) ``engine.state_dict()`` equal a fresh DCP ``get_state_dict``?

    Returns (equal, whether the engine served it from its cache).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mine = engine.state_dict()
    cached = getattr(engine, "_sd_cache", None) is not None
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    same = mine["model"].keys() == model_sd.keys() and all(
        torch.equal(local(mine["model"][k]), local(v)) for k, v in model_sd.items()
    )
    same &= mine["optim"]["state"].keys() == optim_sd["state"].keys()
    for fqn, st in optim_sd["state"].items():
        same &= all(torch.equal(local(mine["optim"]["state"][fqn][k]), local(v)) for k, v in st.items())
    same &= mine["optim"]["param_groups"] == optim_sd["param_groups"]  # the LR moved since the cache was built
    return bool(same), cached


def train_layouts(rank: int, world: int, out_dir: str, layouts: list[Layout], model_cfg=MODEL, train=TRAIN) -> dict:
    """Train every layout in turn on one world-sized process group."""
    return train_layout_groups(rank, world, out_dir, [(layouts, model_cfg, train)])[0]


def train_layout_groups(rank: int, world: int, out_dir: str, groups: list[tuple]) -> list[dict]:
    """``train_layouts`` for each ``(layouts, model_cfg, train)`` of ``groups``, in turn, on
    one spawn of the ranks (one process group): a result dict per group."""
    init_group(rank, world, os.path.join(out_dir, "store"))
    per_group = []
    for layouts, model_cfg, train in groups:
        per_group.append(_train_each(rank, world, layouts, model_cfg, train))
    dist.destroy_process_group()
    return per_group


def _train_each(rank: int, world: int, layouts: list[Layout], model_cfg, train) -> dict:
    results = {}
    for layout in layouts:
        t0 = time.perf_counter()
        engine = make_engine(layout, world, model_cfg, train)
        init_diffs = initial_weight_diffs(engine)
        placements = param_placements(engine)
        losses, norms = train_steps(engine, layout, range(1))
        mlp_calls = count_block_forwards(engine)  # after step 0: PP's first step adds a shape-probing forward
        engine.state_dict()  # builds the cached state dict that later snapshots reuse
        more_losses, more_norms = train_steps(engine, layout, range(1, STEPS))
        cache_ok, cached = state_dict_matches_fresh(engine)
        losses, norms = losses + more_losses, norms + more_norms
        results[layout.name] = {
            "losses": losses,
            "norms": norms,
            "init_diffs": init_diffs,
            "placements": placements,
            "coords": tuple(engine.coords),
            "expected_coords": tuple(engine.dims.coords(rank)),
            "grad_accum": engine.grad_accum,
            "bubble": engine.bubble_fraction,
            "schedule": type(engine.schedule).__name__ if engine.schedule else None,
            "mlp_forwards_per_micro_batch": mlp_calls[0] / ((STEPS - 1) * engine.grad_accum),
            "peak_mem_bytes": engine.peak_mem_bytes(),
            "flops_per_step": engine.flops_per_step,
            "seconds": time.perf_counter() - t0,
            "state_dict_cache_ok": cache_ok,
            "state_dict_cached": cached,
        }
        del engine
    return results


def resize_and_resume(
    rank: int, world: int, out_dir: str, before: Layout, after: Layout, split: int, model_cfg=MODEL, train=TRAIN
) -> dict:
    """Train ``before`` on the full world, checkpoint, shrink the group in-process, resume.

    The process group is destroyed and re-created with ``after.world`` ranks in the same
    processes (as the elastic controller does), then a new engine loads the DCP checkpoint
    through its own (resharded) state dict and keeps training.
    """
    ckpt = os.path.join(out_dir, "ckpt")
    init_group(rank, world, os.path.join(out_dir, "store_a"))
    engine = make_engine(before, world, model_cfg, train)
    losses, norms = train_steps(engine, before, range(split))
    dcp.save(engine.state_dict(), checkpoint_id=ckpt)
    saved_dtypes = sorted(
        {
            str(m.properties.dtype)
            for m in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata.values()
            if hasattr(m, "properties")
        }
    )
    del engine
    dist.destroy_process_group()
    if rank >= after.world:
        return {"losses": losses, "norms": norms, "saved_dtypes": saved_dtypes}

    init_group(rank, after.world, os.path.join(out_dir, "store_b"))
    engine = make_engine(after, after.world, model_cfg, train)
    state = engine.state_dict()
    dcp.load(state, checkpoint_id=ckpt)
    engine.load_state_dict(state)
    resumed_at = engine.step
    more_losses, more_norms = train_steps(engine, after, range(split, STEPS))
    dist.destroy_process_group()
    return {
        "losses": losses + more_losses,
        "norms": norms + more_norms,
        "resumed_at": resumed_at,
        "saved_dtypes": saved_dtypes,
    }


def compile_resize(rank: int, world: int, out_dir: str, before: Layout, after: Layout, model_cfg, train) -> dict:
    """``train.compile``: train ``before``, shrink the group in-process to ``after`` (a new
    engine, as an elastic resize does) and count what dynamo compiled on each side."""
    from torch._dynamo.utils import counters

    ckpt = os.path.join(out_dir, "ckpt")

    def run(layout: Layout, world: int, steps: range) -> dict:
        engine = make_engine(layout, world, model_cfg, train)
        if steps.start > 0:  # resume from the state saved before the resize
            state = engine.state_dict()
            dcp.load(state, checkpoint_id=ckpt)
            engine.load_state_dict(state)
        times, losses, norms = [], [], []
        for step in steps:
            t0 = time.perf_counter()
            loss, norm = train_steps(engine, layout, range(step, step + 1))
            times.append(time.perf_counter() - t0)
            losses += loss
            norms += norm
        if steps.start == 0:
            dcp.save(engine.state_dict(), checkpoint_id=ckpt)
        return {"times": times, "losses": losses, "norms": norms, "graphs": counters["stats"]["unique_graphs"]}

    init_group(rank, world, os.path.join(out_dir, "store_a"))
    first = run(before, world, range(2))
    dist.destroy_process_group()
    if rank >= after.world:
        return {"before": first}
    init_group(rank, after.world, os.path.join(out_dir, "store_b"))
    second = run(after, after.world, range(2, STEPS))
    dist.destroy_process_group()
    return {"before": first, "after": second}


def probe_memory(rank: int, world: int, out_dir: str, groups: list[tuple]) -> list[dict]:
    """For each group ``(layouts, model_cfg, train, steps)``: each layout's peak live tensor
    bytes on this rank, in its last of ``steps`` steps (every group on one spawn of the ranks)."""
    init_group(rank, world, os.path.join(out_dir, "store"))
    results = []
    for layouts, model_cfg, train, steps in groups:
        results.append({})
        for layout in layouts:
            engine = make_engine(layout, world, model_cfg, train, probe_step=steps)
            train_steps(engine, layout, range(steps))
            results[-1][layout.name] = {"peak": engine.probed_peak_bytes, "grad_accum": engine.grad_accum}
            del engine
    dist.destroy_process_group()
    return results


def materialised_shards(rank: int, world: int, out_dir: str, tied: bool) -> dict:
    """Build a GPT under ZeRO-3 over ``world`` ranks through ``parallelize``, noting what
    ``to_empty`` materialised: an untied model is sharded first, so each rank allocates its
    own shards only; a tied one is materialised whole first (see parallelize.py). Either way
    the full weights equal the single-process build from the same seed."""
    from torch.distributed.tensor import DTensor

    from elastic.models.config import GPTConfig
    from elastic.parallel.config import ParallelConfig
    from elastic.parallel.dims import ParallelDims
    from elastic.parallel.parallelize import parallelize

    init_group(rank, world, os.path.join(out_dir, "store"))
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8, tie_embeddings=tied)
    spec = model_spec(cfg)
    with torch.device("meta"):
        model = spec.build()
    seen: list[int] = []
    to_empty = model.to_empty

    def noting(*, device):
        seen.extend(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        return to_empty(device=device)

    model.to_empty = noting
    dims = ParallelDims(dp=world, tp=1, pp=1, world_size=world)
    dims.build_mesh("cpu")
    parallelize(model, dims, ParallelConfig(zero=3), spec, SEED, torch.device("cpu"))
    reference = model_spec(cfg).build_full(SEED).state_dict()

    def equal(m) -> bool:
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in m.state_dict().items()}
        return all(torch.equal(full[n], reference[n]) for n in reference)

    total = sum(p.numel() for p in model_spec(cfg).build_full(SEED).parameters())
    result = {"allocated": sum(seen), "total": total, "equal": equal(model)}
    # A survivor's rebuild: its local shards become the new FSDP's storage (``adopt_shards``),
    # and survive FSDP's lazy init (a forward) as its sharded parameters.
    kept = {n: p.to_local().detach() for n, p in model.named_parameters()}
    with torch.device("meta"):
        again = spec.build()
    emptied: list[int] = []  # nothing is allocated for an adopted shard (``empty_where_meta``)
    if not tied:  # (a tied model is materialised whole before sharding, as above)
        again.to_empty = lambda *, device: emptied.append(1)
    parallelize(again, dims, ParallelConfig(zero=3), spec, SEED, torch.device("cpu"), restoring=True, kept=kept)
    result["to_empty_calls"] = len(emptied)
    again(torch.zeros(1, cfg.seq_len, dtype=torch.long)).sum().backward()
    local = {n: p.to_local() for n, p in again.named_parameters()}
    result["adopted"] = sum(local[n].data_ptr() == kept[n].data_ptr() for n in kept)
    result["params"] = len(kept)
    result["adopted_equal"] = equal(again)
    # Under HSDP every parameter's shard mesh is one slice of the 2-D mesh, made once
    # (``fsdp.slices_made_once``), and slicing is torch's own again afterwards.
    from torch.distributed.device_mesh import DeviceMesh

    getitem = DeviceMesh.__getitem__
    hsdp = ParallelDims(dp=world, tp=1, pp=1, world_size=world, shard_group=1)  # replicas of one rank each
    hsdp.build_mesh("cpu")
    with torch.device("meta"):
        third = spec.build()
    parallelize(third, hsdp, ParallelConfig(zero=3, shard_group=1), spec, SEED, torch.device("cpu"))
    units = [m for m in third.modules() if isinstance(m, FSDPModule)]
    fsdp_params = [fp for u in units for g in u._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params]
    result["hsdp_params"] = len(fsdp_params)
    result["hsdp_shard_meshes"] = len({id(fp.shard_mesh) for fp in fsdp_params})
    result["slicing_restored"] = DeviceMesh.__getitem__ is getitem
    result["hsdp_equal"] = equal(third)
    dist.destroy_process_group()
    return result
