"""What the SDC check costs: the same run with ``elastic.sdc_check_every: 10`` and with it off.

Both sides train ``examples/quickstart.yaml`` (a 4-layer GPT, DP ``--workers``, memory
snapshots every step, no storage checkpoints) on one embedded local Ray, and produce the
same per-step losses (checked: a check never changes the math). Runs alternate (off, on,
off, on, ...) so that drift in the load of a shared machine falls on both sides alike.

Two figures, both side by side:

- **Paired step-time ratio.** Seconds per step in the steady state (after ``--warmup``
  steps: the least-squares slope of the step events' ``ts``), on / off of the same
  repetition; the median and range over repetitions. On a loaded machine this moves by a
  few percent either way on its own, which bounds how small a cost it can show.
- **Direct cost.** What one check adds, timed in this process on the same model: the
  fingerprint of one rank's parameters (``elastic.worker.sdc.fingerprint``), divided by
  ``sdc_check_every`` and by the off side's seconds per step. (The all-gather of one
  integer per rank and the vote are not in it; the paired ratio has everything.)

Usage::

    .venv/bin/python -m benchmarks.sdc_overhead [--workers 2] [--steps 80] [--reps 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks.harness import QUICKSTART
from benchmarks.harness.results import machine, write_json
from benchmarks.harness.stats import least_squares_slope

EVERY = 10


def _run(workers: int, steps: int, every: int, warmup: int) -> tuple[float, dict[int, float]]:
    from elastic import ElasticTrainer
    from elastic.events import read_events
    from jobs import JobSpec

    overrides = [
        f"elastic.min_dp={workers}",
        f"elastic.max_dp={workers}",
        f"train.steps={steps}",
        "checkpoint.every_steps=0",
        f"elastic.sdc_check_every={every}",
        "train.global_batch=48",
    ]
    spec = JobSpec.from_yaml(QUICKSTART, overrides)
    run_dir = tempfile.mkdtemp(prefix="sdc-bench-")
    try:
        result = ElasticTrainer(spec, run_dir=run_dir).fit()
        assert result.status == "succeeded", result
        steps_ev = [e for e in read_events(run_dir) if e["kind"] == "step"]
        assert not [e for e in read_events(run_dir) if e["kind"] == "sdc"], "a check failed in a clean run"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    losses = {e["step"]: e["loss"] for e in steps_ev}
    return least_squares_slope([(e["step"], e["ts"]) for e in steps_ev if e["step"] > warmup]), losses


def _fingerprint_s(reps: int = 50) -> float:
    from elastic.models.spec import model_spec
    from elastic.worker.sdc import fingerprint
    from jobs import JobSpec

    spec = JobSpec.from_yaml(QUICKSTART)
    model = model_spec(spec.model).build_full(seed=0)
    params = list(model.parameters())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fingerprint(params)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray

    ray.init(address="local", num_cpus=max(4, args.workers + 2), include_dashboard=False, log_to_driver=False)
    off, on, ratios = [], [], []
    try:
        for rep in range(args.reps):
            s_off, l_off = _run(args.workers, args.steps, 0, args.warmup)
            s_on, l_on = _run(args.workers, args.steps, EVERY, args.warmup)
            if l_off != l_on:
                print("the losses differ between the runs: not a like-for-like comparison", file=sys.stderr)
                return 1
            off.append(s_off)
            on.append(s_on)
            ratios.append(s_on / s_off)
            print(f"rep {rep}: off {s_off * 1e3:.2f} ms/step, on {s_on * 1e3:.2f} ms/step, ratio {s_on / s_off:.4f}")
    finally:
        ray.shutdown()
    fp_s = _fingerprint_s()
    direct = fp_s / EVERY / statistics.median(off)
    result = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": os.uname().nodename,
        "workers": args.workers,
        "steps": args.steps,
        "sdc_check_every": EVERY,
        "step_s_off": off,
        "step_s_on": on,
        "ratio_on_off": ratios,
        "ratio_median": statistics.median(ratios),
        "fingerprint_s": fp_s,
        "direct_overhead": direct,
        "machine": machine(),
    }
    print(
        f"ratio on/off (sdc_check_every={EVERY}) = {statistics.median(ratios):.4f} "
        f"(range {min(ratios):.4f}..{max(ratios):.4f}, {args.reps} paired reps, goal <= 1.01)"
    )
    print(
        f"fingerprint of one rank's parameters: {fp_s * 1e3:.3f} ms = {direct * 100:.3f}% of a step "
        f"({statistics.median(off) * 1e3:.1f} ms) at one check every {EVERY} steps"
    )
    if args.json:
        write_json(args.json, result, newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
