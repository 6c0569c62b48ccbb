"""Steady-state throughput of the elastic runtime against a plain torchrun DDP script.

Both sides train the same GPT (the project's ``build_model``) with the same optimizer
(``build_optimizer``), the same global batch, micro-batch and gradient accumulation, the
same number of workers (one torch thread each) on gloo, and read the same parquet corpus
rows in the same order (``BatchLayout``). The elastic side is ``ElasticTrainer`` on an
embedded local Ray with its defaults (memory snapshots every step) but no storage
checkpoints (``checkpoint.every_steps=0``); the baseline is
``benchmarks/torchrun_ddp_baseline.py`` under ``python -m torch.distributed.run``.

Runs alternate (baseline, ours, baseline, ours, ...) so that drift in the load of a
shared machine falls on both sides alike. Throughput is measured in the steady state:
the first ``--warmup`` steps are skipped and the seconds per step are the least-squares
slope of the step completion times (``ts`` of ``step`` events in ``events.jsonl`` for
ours; per-step timestamps written by every baseline rank, slowest rank per step). The
slope is used rather than (last - first) so that one slow step at either end of the
window does not decide the figure. (Our step events carry ``ts`` = when the slowest
rank finished the step, as the workers report it, not when the controller polled it.)

The headline is the median over repetitions of the paired ratio (ours / torchrun of the
same repetition): pairing cancels slow drift, and the median keeps one repetition hit by a
burst of load from another user from deciding the result. The ratio of the mean tokens/s
is printed too. It is a ratio measured side by side, not an absolute claim::

    ratio ours/torchrun = X.XX (goal >= 0.97)

Both sides must produce the same per-step losses (same model, optimizer, data order and
batch): the script fails (exit 1) if they differ by more than ``LOSS_RTOL`` relative, so a
ratio is only printed for a like-for-like comparison.

A second, load-robust figure: CPU seconds per step. A sampler reads the CPU time of every
process in each side's process tree (``/proc``) five times a second, and the CPU spent over
the steady window is divided by its steps, for the training processes alone (the Ray
actors; the torchrun ranks) and for the whole job (with the driver, Ray's daemons, the
torchrun launcher). On a machine shared with other work, wall-clock ratios move with the
neighbours' load, while CPU per step barely does; on a saturated host, CPU per step is
what throughput is made of::

    cpu ratio torchrun/ours (training processes) = X.XX; (whole job) = X.XX

Also printed: the time to first step of each side (median over reps), from the launch of
its process tree to step 1 done by every rank (for ours: Python, Ray's start, the workers'
spawn and rendezvous; for torchrun: the launcher and its ranks).

Usage::

    .venv/bin/python -m benchmarks.overhead [--workers 2] [--steps 40] [--reps 3]
        [--size quickstart|tiny|small|medium] [--set KEY=VALUE ...] [--no-snapshot-variant] [--json OUT]

The sides and the report live in ``benchmarks/throughput/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.harness import QUICKSTART
from benchmarks.harness.proc import work_dir
from benchmarks.throughput import report
from benchmarks.throughput.sides import OURS_CHILD_FLAG, ours_child, run_baseline, run_ours

ENTRY = "benchmarks.overhead"

# Model sizes selectable with --size (quickstart = examples/quickstart.yaml unchanged).
SIZES: dict[str, list[str]] = {
    "tiny": ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=256", "model.seq_len=32"],
    "quickstart": [],
    "small": ["model.n_layers=6", "model.d_model=192", "model.n_heads=6", "model.vocab_size=1024", "model.seq_len=64"],
    "medium": [
        "model.n_layers=8",
        "model.d_model=256",
        "model.n_heads=8",
        "model.vocab_size=2048",
        "model.seq_len=128",
    ],
}


def build_spec(args: argparse.Namespace, corpus_uri: str) -> dict:
    from jobs import JobSpec

    overrides = (
        list(SIZES[args.size])
        + list(args.set)
        + [
            f"elastic.min_dp={args.workers}",
            f"elastic.max_dp={args.workers}",
            f"train.steps={args.steps}",
            "checkpoint.every_steps=0",
            f"data.source={corpus_uri}",
            "run_dir=null",
        ]
    )
    spec = JobSpec.from_yaml(args.config, overrides=overrides)
    if spec.parallel.tp != 1 or spec.parallel.pp != 1 or spec.parallel.zero != 0:
        raise SystemExit("overhead.py compares plain DDP: parallel.tp=1, parallel.pp=1, parallel.zero=0")
    return spec.model_dump(mode="json", by_alias=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Steady-state tokens/s: elastic DDP vs plain torchrun DDP, side by side.")
    ap.add_argument("--workers", type=int, default=2, help="DDP workers on each side (default 2)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="steps skipped before the steady window (default 5)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the (torchrun, ours) pair (default 3)")
    ap.add_argument("--config", default=QUICKSTART, help="job spec YAML (default examples/quickstart.yaml)")
    ap.add_argument(
        "--size", choices=sorted(SIZES), default="quickstart", help="model size preset (default quickstart)"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra spec override, e.g. parallel.micro_batch=2",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="hard limit per run in seconds (default 300)")
    ap.add_argument(
        "--no-snapshot-variant",
        action="store_true",
        help="also run ours with checkpoint.memory_every_steps=0 in each rep (attributes the snapshot cost)",
    )
    ap.add_argument("--json", metavar="OUT", help="write the figures as JSON to OUT")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    return ap


def write_specs(work: str, spec_dict: dict) -> tuple[str, str]:
    """The spec of the runs, and the same with memory snapshots off (``--no-snapshot-variant``)."""
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec_dict, f)
    nosnap_path = os.path.join(work, "spec-nosnap.json")
    with open(nosnap_path, "w") as f:
        json.dump({**spec_dict, "checkpoint": {**spec_dict["checkpoint"], "memory_every_steps": 0}}, f)
    return spec_path, nosnap_path


def run_reps(args: argparse.Namespace, work: str, specs: tuple[str, str], corpus_uri: str, tokens: int) -> list[dict]:
    """Alternating (torchrun, ours[, ours-nosnap]) per repetition, so load drift hits every side alike."""
    spec_path, nosnap_path = specs
    runs: list[dict] = []
    for rep in range(args.reps):
        b = run_baseline(
            spec_path, corpus_uri, args.workers, os.path.join(work, f"torchrun-{rep}"), args.timeout, args.warmup
        )
        b["rep"] = rep
        runs.append(b)
        print(f"  rep {rep} torchrun: {tokens / b['s_per_step']:9.0f} tokens/s", flush=True)
        o = run_ours(ENTRY, spec_path, os.path.join(work, f"ours-{rep}"), args.timeout, args.warmup)
        o["rep"] = rep
        runs.append(o)
        print(f"  rep {rep} ours:     {tokens / o['s_per_step']:9.0f} tokens/s", flush=True)
        if args.no_snapshot_variant:
            run_dir = os.path.join(work, f"ours-nosnap-{rep}")
            n = run_ours(ENTRY, nosnap_path, run_dir, args.timeout, args.warmup, "ours-nosnap")
            n["rep"] = rep
            runs.append(n)
            print(f"  rep {rep} ours-nosnap: {tokens / n['s_per_step']:9.0f} tokens/s", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.steps - args.warmup < 2:
        ap.error("--steps must exceed --warmup by at least 2")

    from elastic.ingest.corpus import synthetic_corpus
    from jobs import JobSpec

    with work_dir("bench-overhead-", args.keep) as work:
        base = JobSpec.from_yaml(args.config, overrides=list(SIZES[args.size]) + list(args.set))
        m = base.model
        corpus_path = synthetic_corpus(
            os.path.join(work, "data"), base.data.num_samples, m.seq_len, m.vocab_size, base.seed
        )
        corpus_uri = "file://" + os.path.abspath(corpus_path)
        spec_dict = build_spec(args, corpus_uri)
        spec = JobSpec.from_dict(spec_dict)
        specs = write_specs(work, spec_dict)
        tokens_per_step = spec.train.global_batch * spec.model.seq_len
        print(
            f"model {args.size}: {m.n_layers} layers, d_model {m.d_model}, seq_len {m.seq_len}, vocab {m.vocab_size}; "
            f"{args.workers} workers x 1 thread, global_batch {spec.train.global_batch}, micro_batch "
            f"{spec.parallel.micro_batch}, grad_accum {spec.grad_accum(args.workers)}; {args.steps} steps "
            f"(steady window: steps {args.warmup + 1}..{args.steps}), {args.reps} rep(s) each, alternating",
            flush=True,
        )
        runs = run_reps(args, work, specs, corpus_uri, tokens_per_step)
        fig = report.figures(runs, tokens_per_step)
        loss_diff = report.check_losses(runs)
        report.print_table(runs)
        report.print_figures(runs, fig, loss_diff)
        if args.json:
            report.write_report(args.json, args, spec, tokens_per_step, runs, fig, loss_diff)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == OURS_CHILD_FLAG:
        ours_child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
