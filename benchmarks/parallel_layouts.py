"""Throughput and per-rank memory of parallel layouts on one world, measured side by side.

Every layout trains the same GPT (``build_model`` with the same seed) on the same global
batch through the project's ``TrainEngine``, in one run of ``--world`` spawned ranks (gloo on
127.0.0.1, one torch thread per rank; ``--device cuda`` uses NCCL, one GPU per rank).
Default layouts for 4 ranks::

    DP4 (zero 0)   DP2xTP2   DP2xPP2   TP2xPP2   ZeRO-3xDP4   ZeRO-2+AC xDP2xTP2   ZeRO-1xDP4   TP2xPP2+AC

Phases (all in the same process group, all engines kept alive):

1. per layout, one after another: build the engine, ``--warmup`` steps (PP's first step
   also probes shapes), then one *instrumented* step for memory (below);
2. timing: ``--rounds`` rounds, each giving every layout ``--steps-per-round`` steps in
   turn, so that drift in the load of a shared machine falls on every layout alike.
   Each step starts after a barrier; its time is the slowest rank's (all-reduce MAX) of
   ``forward_backward`` + ``optimizer_step``. Reported: the median step, tokens/s =
   ``global_batch * seq_len / median``, and the ratio to the first layout.

Memory, per rank (the measuring code is ``elastic/testing/layout_memory.py``, shared with
``tests/parallel/test_memory_model_measured.py``, which asserts the same ratio within +-15%):
``state`` (bytes of params, grads and optimizer state held at the end of the step),
``peak`` (the headline: peak live tensor bytes over one instrumented step, a CPU stand-in
for ``torch.cuda.max_memory_allocated``; the real figure on ``--device cuda``) and
``rss_delta`` (the process's peak RSS over the layout's steps, page-granular and noisy).
Next to them, the prediction of ``elastic.parallel.memory_model.estimate_memory`` for the layout
(worst pipeline stage; measured figures are the worst rank) and ``peak/pred``, the ratio
of the measured peak to the predicted total. The PP bubble is the engine's
``bubble_fraction``.

Usage::

    .venv/bin/python -m benchmarks.parallel_layouts [--world 4] [--rounds 3] [--steps-per-round 2]
        [--warmup 2] [--layouts DP4,DP2xTP2,...] [--device cpu|cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict

import torch

from benchmarks.harness.results import write_stamped
from elastic.errors import SpecError
from elastic.models.gpt import ModelConfig
from elastic.testing.layout_memory import (
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MICRO_BATCH,
    DEFAULT_MODEL,
    LAYOUTS,
    Layout,
    peak_vs_prediction,
    run_layouts,
)

MIB = float(1 << 20)


def summarise(layouts: list[Layout], per_rank: list[dict], model_cfg: ModelConfig, args) -> list[dict]:
    rows = []
    tokens_per_step = args.global_batch * model_cfg.seq_len
    for layout in layouts:
        ranks = [r[layout.name] for r in per_rank]
        r0 = ranks[0]
        median_s = statistics.median(r0["step_s"])
        peak, est, ratio = peak_vs_prediction(layout, per_rank, model_cfg, args.micro_batch, args.device)
        rss = [r["rss_delta_bytes"] for r in ranks]
        rows.append(
            {
                "layout": asdict(layout) | {"name": layout.name},
                "grad_accum": r0["grad_accum"],
                "bubble_fraction": r0["bubble_fraction"],
                "step_s_median": median_s,
                "step_s_all": r0["step_s"],
                "tokens_per_s": tokens_per_step / median_s,
                "loss_after_warmup": r0["loss"],
                "measured": {
                    "peak_bytes_max_rank": peak,
                    "peak_over_predicted": ratio,
                    "peak_method": "torch.cuda.max_memory_allocated"
                    if args.device == "cuda"
                    else "live-tensor tracker",
                    "state_bytes_max_rank": max(r["state_bytes"]["total"] for r in ranks),
                    "rss_delta_bytes_max_rank": max(rss) if all(v is not None for v in rss) else None,
                    "rss_method": r0["rss_method"],
                    "per_rank": [
                        {
                            "rank": r["rank"],
                            "coords(dp,pp,tp)": r["coords"],
                            "state": r["state_bytes"],
                            "tracked_peak_bytes": r["tracked_peak_bytes"],
                            "cuda_peak_bytes": r["cuda_peak_bytes"],
                            "rss_delta_bytes": r["rss_delta_bytes"],
                            "engine_peak_mem_bytes": r["engine_peak_mem_bytes"],
                            "build_s": r["build_s"],
                        }
                        for r in ranks
                    ],
                },
                "predicted": {
                    "params": est.params,
                    "grads": est.grads,
                    "optimizer": est.optimizer,
                    "buffers": est.buffers,
                    "activations": est.activations,
                    "logits": est.logits,
                    "total": est.total,
                    "stage": est.stage,
                    "state": est.params + est.grads + est.optimizer,
                },
            }
        )
    return rows


def print_table(rows: list[dict], args, model_cfg: ModelConfig, wall_s: float) -> None:
    base = rows[0]["tokens_per_s"]
    print()
    print(
        f"parallel layouts: world={args.world} device={args.device} model=L{model_cfg.n_layers}/d{model_cfg.d_model}/"
        f"h{model_cfg.n_heads}/V{model_cfg.vocab_size}/T{model_cfg.seq_len} global_batch={args.global_batch} "
        f"micro_batch={args.micro_batch} fp32; {args.rounds}x{args.steps_per_round} timed steps per layout "
        f"(interleaved), run took {wall_s:.0f}s"
    )
    peak_name = "cuda peak" if args.device == "cuda" else "peak(trk)"
    hdr = (
        f"{'layout':<19}{'accum':>5}{'bubble':>7}{'step ms':>9}{'tok/s':>8}{'x' + rows[0]['layout']['name']:>9}"
        f" |{'state':>7}{'pred':>7} |{peak_name:>10}{'pred tot':>9}{'peak/pred':>10}{'rssΔ':>7}"
    )
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
    print(
        "elastic.parallel.memory_model.estimate_memory, fp32, no sequence parallelism). state = params+grads+optimizer"
    )
    print("held at the end of the step (FSDP2 reshards params/grads between steps, so ZeRO-1/2 read lower than")
    print("their in-step prediction); pred = params+grads+optimizer of the model.")
    if args.device == "cuda":
        print(
            "peak = torch.cuda.max_memory_allocated over one step after warm-up, minus memory allocated before the "
            "build."
        )
    else:
        print("peak(trk) = peak live tensor bytes over one instrumented step (dispatch-mode tracker, CPU stand-in for")
        print("max_memory_allocated; misses in-kernel workspaces and C++-only buffers such as gloo's). pred tot =")
        print("params+grads+optimizer+communication buffers+activations (with the recompute working set)+logits.")
    ratios = [r["measured"]["peak_bytes_max_rank"] / r["predicted"]["total"] for r in rows]
    print(
        f"peak/pred over all layouts: {min(ratios):.2f} to {max(ratios):.2f} "
        f"(tests/parallel/test_memory_model_measured.py asserts 0.85 to 1.15 on the default model)."
    )
    method = rows[0]["measured"]["rss_method"]
    print(f"rssΔ = peak RSS after the build minus RSS before it ({method}); page-granular and polluted by the")
    print("allocator and gloo on CPU at this model size: an upper-level sanity check, not the measurement.")
    print(
        "tok/s = global_batch*seq_len / median step (slowest rank, after a barrier); bubble = engine.bubble_fraction."
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--layouts",
        default=",".join(lay.name for lay in LAYOUTS),
        help="comma-separated subset of: " + ", ".join(lay.name for lay in LAYOUTS),
    )
    ap.add_argument("--layers", type=int, default=DEFAULT_MODEL.n_layers)
    ap.add_argument("--d-model", type=int, default=DEFAULT_MODEL.d_model)
    ap.add_argument("--heads", type=int, default=DEFAULT_MODEL.n_heads)
    ap.add_argument("--vocab", type=int, default=DEFAULT_MODEL.vocab_size)
    ap.add_argument("--seq", type=int, default=DEFAULT_MODEL.seq_len)
    ap.add_argument("--global-batch", type=int, default=DEFAULT_GLOBAL_BATCH)
    ap.add_argument("--micro-batch", type=int, default=DEFAULT_MICRO_BATCH)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

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
    model_cfg = ModelConfig(
        n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, vocab_size=args.vocab, seq_len=args.seq
    )
    for lay in layouts:  # in the ranks, a layout the model cannot take was a traceback per rank, exit 1
        try:
            model_cfg.validate_layout(lay.tp, lay.pp)
        except SpecError as exc:
            ap.error(f"layout {lay.name} does not fit the model (--layers, --heads, --d-model): {exc}")
        if args.global_batch % (lay.dp * args.micro_batch):
            ap.error(f"layout {lay.name}: --global-batch {args.global_batch} is not a multiple of dp {lay.dp} "
                     f"x --micro-batch {args.micro_batch}")  # fmt: skip
    t0 = time.perf_counter()
    per_rank = run_layouts(
        layouts,
        model_cfg,
        world=args.world,
        device=args.device,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        warmup=args.warmup,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        seed=args.seed,
    )
    wall_s = time.perf_counter() - t0
    rows = summarise(layouts, per_rank, model_cfg, args)
    print_table(rows, args, model_cfg, wall_s)
    if args.json_out:
        doc = {
            "config": {k: v for k, v in vars(args).items() if k != "json_out"},
            "model": model_cfg.model_dump(),
            "wall_s": wall_s,
            "layouts": rows,
        }
        write_stamped(args.json_out, doc)


if __name__ == "__main__":
    main()
