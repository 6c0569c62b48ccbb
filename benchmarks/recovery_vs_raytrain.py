"""Recovery from a lost node: the elastic runtime against Ray Train V2 (tuned and default),
TorchFT, and Ray Train V2 with TorchFT, side by side, repeated.

The same failure scenario every way, each run on a fresh ``ray.cluster_utils.Cluster`` in
its own child process (private ``TMPDIR``, so nothing else can join it): a head with
``num_cpus=0`` and 4 worker nodes with ``num_cpus=1``, one training process per node, a
GPT of 4.2 M parameters (50.5 MB of training state: fp32 weights plus AdamW's two
moments) on gloo, the same corpus and optimizer. When step ``k`` (default 12) has been
completed, the node that hosts rank (replica) 1 is killed from a driver thread: SIGKILL of
every process that is a child of its raylet, then ``Cluster.remove_node`` (the project's
``kill_node``). The benchmark stamps ``kill_ts`` just before the SIGKILL.

Sides (each described in full in its module under ``benchmarks/recovery/``):

- ``ours``: ``ElasticTrainer`` (``min_dp=1, max_dp=4``), memory snapshots every step,
  storage checkpoints every 5 steps; a node is added back 1 s after the first step at the
  new size, to time the grow-back (``rejoin_s``). ``side_ours.py``.
- ``raytrain_tuned``: Ray Train V2 ``TorchTrainer`` (``num_workers=(1, 4)``, elastic,
  ``max_failures=3``) as a savvy user would run it: ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=5``,
  ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2``, Ray health checks every 0.5 s with 3 misses
  (``_system_config``), and a checkpoint every step (the frequency of our memory tier).
  ``side_raytrain.py``.
- ``raytrain_default``: the same at Ray's and Ray Train's defaults, a checkpoint every 5
  steps. ``side_raytrain.py``.
- ``torchft``: torchft 0.2.0 standalone (``Manager`` + ``LighthouseServer`` with a 1 s
  heartbeat timeout, ``ProcessGroupGloo`` with a 10 s timeout), one replica group of one
  process per node, each a Ray task; a node is added back after the first step without the
  lost replica, and a new replica heals from a live peer. torchft keeps its own semantics:
  each replica trains a fixed 3 rows per step, so the global batch shrinks from 12 to 9 when
  a replica is lost (ours and Ray Train keep 12). torchft must be importable (``make
  bench-deps``, or ``--torchft-path DIR``); otherwise the side is reported as skipped, with
  the reason. ``side_torchft.py``.
- ``raytrain_torchft``: Ray Train V2 ``TorchTrainer`` with ``TorchftConfig`` (the Ray-native
  in-place fault tolerance), each worker its own replica group, one per node, trained as
  ``torchft`` is; a run whose ``fit()`` has not returned by the time limit is reported
  ``completed: false`` with the reason, not as a crash. ``side_raytrain_torchft.py``.

Same definitions on every side, from per-step worker progress:

- **recovery** (``downtime``) = from ``kill_ts`` to the first step completed (by every
  rank of the new group) at the smaller size, by the workers' own wall-clock stamps (all
  processes are on this one machine, so they share its clock);
- **lost steps** = the last step any worker completed before the recovery minus the step
  training resumed from (ours: ``summary.json`` ``recoveries[0].lost_steps``, which the
  controller computes from the steps workers reported themselves; Ray Train and TorchFT:
  the progress lines each worker appends after every step).

Each side has a hard time limit; a side that does not recover in time is reported as such.
Every repetition, the medians and ranges, the host, the UTC date and the versions go to a
JSON results file (default ``benchmarks/results/recovery.json``), which ``elastic demo``
quotes. Usage::

    .venv/bin/python -m benchmarks.recovery_vs_raytrain [--reps 3] [--sides ours,raytrain_tuned,...]

(``python benchmarks/recovery_vs_raytrain.py`` is the same.) The sides, the driver and the
report live in ``benchmarks/recovery/``, one module per side.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from typing import Any

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.proc import module_command, work_dir
from benchmarks.harness.results import write_json
from benchmarks.recovery import report
from benchmarks.recovery.driver import ENTRY, run_child, run_side
from benchmarks.recovery.scenario import (
    DEFAULT_RESULTS,
    GLOBAL_BATCH,
    MODEL,
    MODEL_ENV,
    MODELS,
    NODES,
    NODES_ENV,
    SIDES,
    TORCHFT_SIDES,
    param_count,
    spec_dict,
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Node-loss recovery: elastic runtime vs Ray Train V2 (tuned, default) and TorchFT."
    )
    ap.add_argument("--kill-step", type=int, default=12, help="kill the node when this step has completed (default 12)")
    ap.add_argument("--kill-rank", type=int, default=1, help="kill the node hosting this rank / replica (default 1)")
    ap.add_argument(
        "--steps",
        type=int,
        default=60,
        help="training steps of the Ray Train runs (and of ours/TorchFT with --return-delay -1) (default 60)",
    )
    ap.add_argument(
        "--rejoin-steps",
        type=int,
        default=150,
        help="training steps of ours and TorchFT, which also time a returning node (default 150)",
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions per side (default 3)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    ap.add_argument(
        "--return-delay",
        type=float,
        default=1.0,
        help="ours and torchft: add a node back this long after the first step at the smaller size (-1: never)",
    )
    ap.add_argument(
        "--torchft-path",
        default=os.environ.get("TORCHFT_PATH"),
        help="a directory to put on PYTHONPATH for the torchft side (pip install --target DIR torchft==0.2.0 ...)",
    )
    # One run's wall-clock bound per side: the ~100M model's 20 steps took 4-13 s each on a loaded
    # 2-core host (2026-11-29), and 150 s cut one of our runs off after it had recovered.
    for side in ("ours", "raytrain", "torchft"):
        ap.add_argument(f"--{side}-timeout", type=float, default=300.0, help="seconds one run of that side may take")
    ap.add_argument(
        "--results",
        default=DEFAULT_RESULTS,
        help=f"results JSON (default {os.path.relpath(DEFAULT_RESULTS, REPO_ROOT)}; '' to skip)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs, events, progress)")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="model size (default small)")
    ap.add_argument("--nodes", type=int, choices=(2, 3, 4), default=None, help="nodes, one worker each (default 4)")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    return ap


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The sides to run; exits 2 with the option at fault on bad input."""
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        ap.error(f"--sides: unknown side(s) {bad}; choose from {', '.join(SIDES)}")
    if not 1 <= args.kill_step < args.steps:
        ap.error("--kill-step must be between 1 and --steps - 1")
    if not 0 <= args.kill_rank < NODES:
        ap.error(f"--kill-rank must be in 0..{NODES - 1}")
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    return sides


def _without(argv: list[str], flags: dict[str, Any]) -> list[str]:
    """``argv`` less the given flags and their values (both ``--flag value`` and ``--flag=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    model_set = args.model is not None and MODELS[args.model] is not MODEL
    if model_set or (args.nodes is not None and args.nodes != NODES):  # re-run with the scenario fixed for the children
        env = dict(os.environ)
        if args.model is not None:
            env[MODEL_ENV] = args.model
        if args.nodes is not None:
            env[NODES_ENV] = str(args.nodes)
        rest = _without(argv if argv is not None else sys.argv[1:], {"--model": args.model, "--nodes": args.nodes})
        return subprocess.call(module_command(ENTRY, *rest), env=env)
    if args._child:
        run_child(args._child)
        return 0
    sides = check(ap, args)

    from elastic.ingest.corpus import synthetic_corpus

    started = datetime.datetime.now(datetime.timezone.utc)
    with work_dir("bench-recovery-", args.keep) as work:
        m = MODEL
        state_mb = 12 * param_count(m) / 1e6  # fp32 weights + two AdamW moments
        corpus = synthetic_corpus(os.path.join(work, "data"), 4000, m["seq_len"], m["vocab_size"], 0)
        spec_path = os.path.join(work, "spec.json")
        write_json(spec_path, spec_dict(args.steps, "file://" + os.path.abspath(corpus)))
        print(
            f"{NODES}-node local cluster (head num_cpus=0, {NODES} x num_cpus=1), GPT {m} ({state_mb:.1f} MB of "
            f"weights + AdamW state), global_batch {GLOBAL_BATCH}, {args.steps} steps "
            f"(ours and TorchFT: {args.rejoin_steps}, to "
            "time a "
            f"returning node {args.return_delay:g} s after the first step at the smaller size); "
            f"the node of rank {args.kill_rank} is killed "
            f"(SIGKILL of its raylet's children + remove_node) when step {args.kill_step} completes; {args.reps} "
            f"repetition(s) per side; load average now {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs",
            flush=True,
        )
        res = run_reps(sides, args, spec_path, work)
        summ = report.summarise(res)
        rat = report.ratios(summ)
        report.print_summary(sides, summ, rat)
        if args.results:
            report.write_results(args.results, args, started, state_mb, res, summ, rat)
    return 0


def run_reps(sides: list[str], args: argparse.Namespace, spec_path: str, work: str) -> dict[str, list[dict[str, Any]]]:
    res: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for rep in range(args.reps):  # interleaved, so drifting load hits every side alike
        for side in sides:
            if side in TORCHFT_SIDES and res[side] and res[side][0].get("status") == "skipped":
                res[side].append(dict(res[side][0], rep=rep))
                continue
            print(f"[rep {rep + 1}/{args.reps}] {side} ...", flush=True)
            r = run_side(side, rep, args, spec_path, work)
            res[side].append(r)
            report.print_run(side, r)
    return res


if __name__ == "__main__":
    sys.exit(main())
