"""Throughput and per-rank memory of parallel layouts on one world, measured side by side.

Every layout trains the same GPT (``build_model`` with the same seed) on the same global
batch through the project's ``TrainEngine``, in one run of ``--world`` spawned ranks (gloo on
127.0.0.1, one torch thread per rank; ``--device cuda`` uses NCCL, one GPU per rank).
Default layouts for 4 ranks::

    DP4 (zero 0)   DP2xTP2   DP2xPP2   TP2xPP2   ZeRO-3xDP4   ZeRO-2+AC xDP2xTP2   ZeRO-1xDP4

Phases (all in the same process group, all engines kept alive):

1. per layout, one after another: build the engine, ``--warmup`` steps (PP's first step
   also probes shapes), then one *instrumented* step for memory (below);
2. timing: ``--rounds`` rounds, each giving every layout ``--steps-per-round`` steps in
   turn, so that drift in the load of a shared machine falls on every layout alike.
   Each step starts after a barrier; its time is the slowest rank's (all-reduce MAX) of
   ``forward_backward`` + ``optimizer_step``. Reported: the median step, tokens/s =
   ``global_batch * seq_len / median``, and the ratio to the first layout.

Memory, per rank, three figures and the prediction next to them:

* ``state``: exact bytes of the tensors this rank holds for its parameters (local shards
  of DTensors), its gradients (taken after the last backward of the step, before the
  optimizer step) and its optimizer state (after the step). Compared with the memory
  model's ``params + grads + optimizer``. Caveat: FSDP2 keeps parameters and gradients
  sharded *between* steps at every ZeRO level, so for ZeRO-1/2 this end-of-step figure
  is below the in-step figure the memory model describes (full params during the step,
  full grads for ZeRO-1); the ``peak`` column sees the in-step figure.
* ``peak`` (the headline): the peak of live tensor bytes during the instrumented step,
  a CPU stand-in for ``torch.cuda.max_memory_allocated``. A ``TorchDispatchMode`` sees
  the storage of every tensor an op returns (DTensors and other wrapper subclasses are
  flattened to their local tensors), ``UntypedStorage.resize_`` is wrapped (FSDP2 frees
  and re-allocates its unsharded parameters that way), and a weak reference per storage
  removes its bytes when it is freed. Parameters, buffers and optimizer state are
  registered when the step starts. The peak is sampled after every op and every resize,
  which is where memory grows. What it cannot see: memory allocated inside a kernel and
  freed before it returns (workspaces), buffers owned by C++ that no op ever returns to
  Python (classic DDP's reducer buckets are seen only once a bucket view is returned by
  an op; gloo's own staging buffers never), allocator overheads and fragmentation, and
  tensors that exist before the step but are first touched after the peak. The
  instrumented step is not timed (the mode costs Python work on every op).
* ``rss_delta``: the process's peak resident set (``VmHWM`` from ``/proc/self/status``,
  reset by writing ``5`` to ``/proc/self/clear_refs`` after the engine is built) minus its
  resident set right before the engine was built (after ``gc.collect`` and
  ``malloc_trim``). It covers the layout's warm-up and instrumented steps (phase 1; the
  timing rounds come later and are not in it). It is honest about everything the process
  holds, but on CPU it is noisy at this model size: glibc keeps freed heap for reuse
  (under-count when an earlier layout left free heap behind), gloo and Python allocate
  on first use (over-count), and the figure is in pages. It
  excludes the engine's construction transient (the full seeded model is built on every
  rank before it is cut and sharded). Where ``clear_refs`` is not writable it falls back
  to ``ru_maxrss`` (monotonic over the process, so only the first layout's figure means
  anything) and says so.

On ``--device cuda`` the ``peak`` column is ``torch.cuda.max_memory_allocated`` (reset after
the warm-up) minus ``memory_allocated`` right before the engine was built: the exact
figure, which the CPU tracker only approximates. That path is written for a GPU machine
and has not been run on this CPU-only one.

The prediction is ``elastic.memory_model.estimate_memory`` at the layout's tp/pp/dp/zero,
micro-batch, recompute flag, ``dtype_bytes=4`` (the engine trains in fp32), the real
number of micro-batches per step and the PP schedule, with ``sequence_parallel=False``
(the TP plan has no sequence parallelism). It is the worst pipeline stage; the measured
figures are the worst rank. The PP bubble is the engine's ``bubble_fraction``.

Usage::

    .venv/bin/python benchmarks/parallel_layouts.py [--world 4] [--rounds 3] [--steps-per-round 2]
        [--warmup 2] [--layouts DP4,DP2xTP2,...] [--device cpu|cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import gc
import json
import os
import re
import resource
import socket
import statistics
import sys
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: E402

from elastic.memory_model import estimate_memory  # noqa: E402
from elastic.model import ModelConfig  # noqa: E402
from elastic.optim import TrainConfig  # noqa: E402
from elastic.parallel.config import ParallelConfig  # noqa: E402
from elastic.parallel.dims import ParallelDims  # noqa: E402
from elastic.parallel.engine import TrainEngine  # noqa: E402

MIB = float(1 << 20)


@dataclass(frozen=True)
class Layout:
    name: str
    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    ac: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


LAYOUTS = [
    Layout("DP4", dp=4),
    Layout("DP2xTP2", dp=2, tp=2),
    Layout("DP2xPP2", dp=2, pp=2),
    Layout("TP2xPP2", dp=1, tp=2, pp=2),
    Layout("ZeRO-3xDP4", dp=4, zero=3),
    Layout("ZeRO-2+ACxDP2xTP2", dp=2, tp=2, zero=2, ac=True),
    Layout("ZeRO-1xDP4", dp=4, zero=1),
]


# --------------------------------------------------------------------------- memory probes


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The real storages behind ``t`` (wrapper subclasses such as DTensor flattened)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        out: list[torch.UntypedStorage] = []
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                out.extend(_storages(inner))
        return out
    if t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors in a nest of dicts, lists and tuples (no closure: no reference cycle
    that would keep the tensors alive past their last use)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return out


def tensor_bytes(tensors, device: torch.device) -> int:
    """Bytes of the distinct storages behind ``tensors`` on ``device``."""
    seen: dict[int, int] = {}
    for t in tensors:
        for st in _storages(t):
            if st.device.type == device.type:
                seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages on one device type; see the module docstring."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type = device.type
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, bytes counted]
        self.current = 0
        self.peak = 0
        self._orig_resize = None

    def register(self, tensors) -> None:
        for t in tensors:
            for st in _storages(t):
                self._track(st)

    def _track(self, st: torch.UntypedStorage) -> None:
        if st.device.type != self.device_type:
            return
        nbytes = st.nbytes()
        entry = self._live.get(id(st))
        if entry is None:
            key = id(st)
            self._live[key] = [weakref.ref(st, functools.partial(self._gone, key)), nbytes]
            self.current += nbytes
        elif entry[1] != nbytes:
            self.current += nbytes - entry[1]
            entry[1] = nbytes
        if self.current > self.peak:
            self.peak = self.current

    def _gone(self, key: int, _ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def __enter__(self):
        tracker, orig = self, torch.UntypedStorage.resize_
        self._orig_resize = orig

        def resize_(st, size):
            out = orig(st, size)
            tracker._track(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            for st in _storages(t):
                self._track(st)
        return out


_LIBC = None


def _malloc_trim() -> None:
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


class RssProbe:
    """Resident-set delta from a baseline taken before the engine is built."""

    def __init__(self):
        gc.collect()
        _malloc_trim()
        self.base_kib = _status_kib("VmRSS")
        self.method = "VmHWM-reset"

    def reset_peak(self) -> None:
        gc.collect()
        _malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "ru_maxrss(monotonic)"

    def delta_bytes(self) -> int | None:
        if self.base_kib is None:
            return None
        if self.method == "VmHWM-reset":
            peak = _status_kib("VmHWM")
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return None if peak is None else max(0, peak - self.base_kib) * 1024


# --------------------------------------------------------------------------- per rank


def make_batches(cfg: ModelConfig, global_batch: int, micro_batch: int, dp: int, dp_rank: int, step: int):
    """This DP rank's micro-batches of a deterministic random batch (the same for every layout)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_len + 1), generator=gen)
    per_rank = global_batch // dp
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [
        (mine[i : i + micro_batch, :-1].contiguous(), mine[i : i + micro_batch, 1:].contiguous())
        for i in range(0, per_rank, micro_batch)
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def rank_main(rank: int, world: int, cfg: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    device_type = cfg["device"]
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    model_cfg = ModelConfig(**cfg["model"])
    train_cfg = TrainConfig(steps=10_000, global_batch=cfg["global_batch"], lr=1e-4, warmup_steps=1)
    layouts = [Layout(**d) for d in cfg["layouts"]]
    mb = cfg["micro_batch"]
    engines: dict[str, TrainEngine] = {}
    results: dict[str, dict] = {}
    step_no: dict[str, int] = {}

    def batches(layout: Layout, engine: TrainEngine):
        step = step_no[layout.name]
        step_no[layout.name] = step + 1
        return make_batches(model_cfg, cfg["global_batch"], mb, layout.dp, engine.coords.dp_rank, step)

    # ----- phase 1: build, warm up, one instrumented step, per layout --------------------
    for layout in layouts:
        pcfg = ParallelConfig(tp=layout.tp, pp=layout.pp, zero=layout.zero, micro_batch=mb,
                              activation_checkpointing=layout.ac)
        dims = ParallelDims(dp=layout.dp, tp=layout.tp, pp=layout.pp, world_size=world)
        dist.barrier()
        rss = RssProbe()
        cuda_base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        engine = TrainEngine(model_cfg, pcfg, train_cfg, dims, seed=cfg["seed"], device=device)
        build_s = time.perf_counter() - t0
        rss.reset_peak()
        engines[layout.name], step_no[layout.name] = engine, 0
        for _ in range(cfg["warmup"]):
            engine.forward_backward(batches(layout, engine))
            engine.optimizer_step()
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        # The instrumented step.
        mbs = batches(layout, engine)
        gc.collect()
        tracker = LiveTensorBytes(device)
        with tracker:
            tracker.register(list(engine.model.parameters()) + list(engine.model.buffers()))
            tracker.register(_tensors(engine.optimizer.state))
            tracker.register([t for pair in mbs for t in pair])
            loss = engine.forward_backward(mbs)
            params = [p for p in engine.model.parameters()]
            params_b = tensor_bytes(params, device)
            grads_b = tensor_bytes([p.grad for p in params if p.grad is not None], device)
            engine.optimizer_step()
        _sync(device)
        optim_b = tensor_bytes(_tensors(engine.optimizer.state), device)
        peak = tracker.peak
        if device.type == "cuda":
            cuda_peak = int(torch.cuda.max_memory_allocated(device)) - cuda_base
        results[layout.name] = {
            "rank": rank,
            "coords": list(engine.coords),
            "grad_accum": engine.grad_accum,
            "bubble_fraction": engine.bubble_fraction,
            "build_s": build_s,
            "loss": loss,
            "state_bytes": {"params": params_b, "grads": grads_b, "optimizer": optim_b,
                            "total": params_b + grads_b + optim_b},
            "tracked_peak_bytes": peak,
            "cuda_peak_bytes": cuda_peak if device.type == "cuda" else None,
            "rss_delta_bytes": rss.delta_bytes(),
            "rss_method": rss.method,
            # The engine's own figure: process-lifetime ru_maxrss on CPU (absolute, monotonic
            # over all layouts of this process), max_memory_allocated on CUDA.
            "engine_peak_mem_bytes": engine.peak_mem_bytes(),
            "step_s": [],
        }

    # ----- phase 2: interleaved timing rounds --------------------------------------------
    for _ in range(cfg["rounds"]):
        for layout in layouts:
            engine = engines[layout.name]
            for _ in range(cfg["steps_per_round"]):
                mbs = batches(layout, engine)
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                engine.forward_backward(mbs)
                engine.optimizer_step()
                _sync(device)
                dt = time.perf_counter() - t0
                results[layout.name]["step_s"].append(_max_over_ranks(dt, device))

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def predict(layout: Layout, model_cfg: ModelConfig, micro_batch: int, grad_accum: int):
    return estimate_memory(
        model_cfg, tp=layout.tp, pp=layout.pp, dp=layout.dp, zero=layout.zero, micro_batch=micro_batch,
        activation_checkpointing=layout.ac, dtype_bytes=4, sequence_parallel=False,
        num_microbatches=grad_accum, pp_schedule="1f1b",
    )


def summarise(layouts: list[Layout], per_rank: list[dict], model_cfg: ModelConfig, args) -> list[dict]:
    rows = []
    tokens_per_step = args.global_batch * model_cfg.seq_len
    for layout in layouts:
        ranks = [r[layout.name] for r in per_rank]
        r0 = ranks[0]
        median_s = statistics.median(r0["step_s"])
        est = predict(layout, model_cfg, args.micro_batch, r0["grad_accum"])
        peak_key = "cuda_peak_bytes" if args.device == "cuda" else "tracked_peak_bytes"
        rss = [r["rss_delta_bytes"] for r in ranks]
        rows.append({
            "layout": asdict(layout) | {"name": layout.name},
            "grad_accum": r0["grad_accum"],
            "bubble_fraction": r0["bubble_fraction"],
            "step_s_median": median_s,
            "step_s_all": r0["step_s"],
            "tokens_per_s": tokens_per_step / median_s,
            "loss_after_warmup": r0["loss"],
            "measured": {
                "peak_bytes_max_rank": max(r[peak_key] for r in ranks),
                "peak_method": "torch.cuda.max_memory_allocated" if args.device == "cuda" else "live-tensor tracker",
                "state_bytes_max_rank": max(r["state_bytes"]["total"] for r in ranks),
                "rss_delta_bytes_max_rank": max(rss) if all(v is not None for v in rss) else None,
                "rss_method": r0["rss_method"],
                "per_rank": [
                    {"rank": r["rank"], "coords(dp,pp,tp)": r["coords"], "state": r["state_bytes"],
                     "tracked_peak_bytes": r["tracked_peak_bytes"], "cuda_peak_bytes": r["cuda_peak_bytes"],
                     "rss_delta_bytes": r["rss_delta_bytes"], "engine_peak_mem_bytes": r["engine_peak_mem_bytes"],
                     "build_s": r["build_s"]}
                    for r in ranks
                ],
            },
            "predicted": {
                "params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                "activations": est.activations, "logits": est.logits, "total": est.total, "stage": est.stage,
                "state": est.params + est.grads + est.optimizer,
            },
        })
    return rows


def print_table(rows: list[dict], args, model_cfg: ModelConfig, wall_s: float) -> None:
    base = rows[0]["tokens_per_s"]
    print()
    print(f"parallel layouts: world={args.world} device={args.device} model=L{model_cfg.n_layers}/d{model_cfg.d_model}/"
          f"h{model_cfg.n_heads}/V{model_cfg.vocab_size}/T{model_cfg.seq_len} global_batch={args.global_batch} "
          f"micro_batch={args.micro_batch} fp32; {args.rounds}x{args.steps_per_round} timed steps per layout "
          f"(interleaved), run took {wall_s:.0f}s")
    peak_name = "cuda peak" if args.device == "cuda" else "peak(trk)"
    hdr = (f"{'layout':<19}{'accum':>5}{'bubble':>7}{'step ms':>9}{'tok/s':>8}{'x' + rows[0]['layout']['name']:>9}"
           f" |{'state':>7}{'pred':>7} |{peak_name:>10}{'pred tot':>9}{'peak/pred':>10}{'rssΔ':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        m, p = r["measured"], r["predicted"]
        rss = m["rss_delta_bytes_max_rank"]
        print(
            f"{r['layout']['name']:<19}{r['grad_accum']:>5}{r['bubble_fraction']:>7.3f}{r['step_s_median'] * 1e3:>9.0f}"
            f"{r['tokens_per_s']:>8.0f}{r['tokens_per_s'] / base:>9.2f}"
            f" |{m['state_bytes_max_rank'] / MIB:>7.2f}{p['state'] / MIB:>7.2f}"
            f" |{m['peak_bytes_max_rank'] / MIB:>10.2f}{p['total'] / MIB:>9.2f}"
            f"{m['peak_bytes_max_rank'] / p['total']:>10.2f}{'n/a' if rss is None else f'{rss / MIB:.1f}':>7}"
        )
    print()
    print("Memory columns are MiB per rank, worst rank (measured) vs worst pipeline stage (predicted by")
    print("elastic.memory_model.estimate_memory, fp32, no sequence parallelism). state = params+grads+optimizer")
    print("held at the end of the step (FSDP2 reshards params/grads between steps, so ZeRO-1/2 read lower than")
    print("their in-step prediction); pred = params+grads+optimizer of the model.")
    if args.device == "cuda":
        print("peak = torch.cuda.max_memory_allocated over one step after warm-up, minus memory allocated before the build.")
    else:
        print("peak(trk) = peak live tensor bytes over one instrumented step (dispatch-mode tracker, CPU stand-in for")
        print("max_memory_allocated; misses in-kernel workspaces and C++-only buffers such as gloo's). pred tot =")
        print("params+grads+optimizer+activations+logits.")
    method = rows[0]["measured"]["rss_method"]
    print(f"rssΔ = peak RSS after the build minus RSS before it ({method}); page-granular and polluted by the")
    print("allocator and gloo on CPU at this model size: an upper-level sanity check, not the measurement.")
    print("tok/s = global_batch*seq_len / median step (slowest rank, after a barrier); bubble = engine.bubble_fraction.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--layouts", default=",".join(lay.name for lay in LAYOUTS),
                    help="comma-separated subset of: " + ", ".join(lay.name for lay in LAYOUTS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    by_name = {lay.name: lay for lay in LAYOUTS}
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        ap.error(f"unknown layouts {unknown}; choose from {list(by_name)}")
    layouts = [by_name[n] for n in names]
    bad = [lay.name for lay in layouts if lay.world != args.world]
    if bad:
        ap.error(f"layouts {bad} need a world other than --world {args.world}")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        ap.error(f"--device cuda needs {args.world} GPUs, found {torch.cuda.device_count()}")
    model_cfg = ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                            vocab_size=args.vocab, seq_len=args.seq)
    cfg = {
        "device": args.device, "port": _free_port(), "model": model_cfg.model_dump(),
        "global_batch": args.global_batch, "micro_batch": args.micro_batch, "warmup": args.warmup,
        "rounds": args.rounds, "steps_per_round": args.steps_per_round, "seed": args.seed,
        "layouts": [asdict(lay) for lay in layouts],
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="parallel_layouts-") as out_dir:
        mp.start_processes(rank_main, args=(args.world, cfg, out_dir), nprocs=args.world, join=True,
                           start_method="spawn")
        per_rank = []
        for rank in range(args.world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    wall_s = time.perf_counter() - t0
    rows = summarise(layouts, per_rank, model_cfg, args)
    print_table(rows, args, model_cfg, wall_s)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json_out"},
                       "model": model_cfg.model_dump(), "wall_s": wall_s, "layouts": rows}, f, indent=2)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
