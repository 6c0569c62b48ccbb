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

Usage::

    .venv/bin/python benchmarks/overhead.py [--workers 2] [--steps 40] [--reps 3]
        [--size quickstart|tiny|small|medium] [--set KEY=VALUE ...] [--no-snapshot-variant] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from elastic.testing.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BASELINE = os.path.join(ROOT, "benchmarks", "torchrun_ddp_baseline.py")
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.yaml")

# A steady window shorter than this is too short for a stable slope on a noisy machine.
MIN_WINDOW_S = 5.0
LOSS_RTOL = 1e-5  # same math and data order on both sides; only the loss mean's summation order differs
CPU_SAMPLE_S = 0.2

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


# --------------------------------------------------------------------------- helpers


def seconds_per_step(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of completion time against step number."""
    n = len(points)
    if n < 2:
        raise ValueError("need at least two steps in the steady window")
    xs = [float(s) for s, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def theil_sen(points: list[tuple[int, float]]) -> float:
    """Median of the pairwise slopes: robust to a burst of load from another tenant."""
    slopes = [(t2 - t1) / (s2 - s1) for i, (s1, t1) in enumerate(points) for s2, t2 in points[i + 1 :] if s2 != s1]
    return statistics.median(slopes)


class TreeCPU(threading.Thread):
    """Samples the CPU seconds (user + system) of a process tree from ``/proc``.

    Each sample is ``(unix time, whole tree, training processes)``; a process that has exited
    keeps counting with its last reading, so a sum never drops.
    """

    def __init__(self, root: int, is_trainer):
        super().__init__(daemon=True)
        self.root, self.is_trainer = root, is_trainer
        self.samples: list[tuple[float, float, float]] = []
        self._last: dict[int, tuple[float, bool]] = {}
        self._halt = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")

    def _scan(self) -> None:
        stats: dict[int, tuple[int, float]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self._tick)
        tree, frontier = {self.root}, [self.root]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        while frontier:
            for c in children.get(frontier.pop(), []):
                if c not in tree:
                    tree.add(c)
                    frontier.append(c)
        for pid in tree:
            if pid not in stats:
                continue
            # A Ray worker process becomes an actor after it starts (its title changes): look
            # again until it is one.
            trainer = (pid in self._last and self._last[pid][1]) or self._trainer(pid)
            self._last[pid] = (stats[pid][1], trainer)

    def _trainer(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return self.is_trainer(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            return False

    def run(self) -> None:
        while not self._halt.wait(CPU_SAMPLE_S):
            self._scan()
            total = sum(c for c, _ in self._last.values())
            trainers = sum(c for c, t in self._last.values() if t)
            self.samples.append((time.time(), total, trainers))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def cpu_between(self, t0: float, t1: float) -> tuple[float, float]:
        """(whole tree, training processes) CPU seconds spent between unix times t0 and t1."""

        def at(t: float, i: int) -> float:
            pts = self.samples
            for (ta, *a), (tb, *b) in zip(pts, pts[1:]):
                if ta <= t <= tb:
                    return a[i] + (b[i] - a[i]) * (t - ta) / (tb - ta) if tb > ta else a[i]
            raise ValueError("time outside the sampled window")

        return at(t1, 0) - at(t0, 0), at(t1, 1) - at(t0, 1)


def run_subprocess(
    cmd: list[str], timeout: float, env: dict[str, str], log_path: str, is_trainer=None
) -> tuple[int, float, TreeCPU | None]:
    """Run ``cmd`` in its own session with a hard timeout; the whole session is killed on expiry."""
    t0 = time.time()
    sampler = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if is_trainer is not None:
            sampler = TreeCPU(proc.pid, is_trainer)
            sampler.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        finally:
            if sampler is not None:
                sampler.stop()
    return rc, time.time() - t0, sampler


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("RAY_ADDRESS", None)  # ours starts its own embedded Ray, never someone else's
    return env


# --------------------------------------------------------------------------- the two sides


def run_baseline(spec_path: str, corpus: str, workers: int, out_dir: str, timeout: float, warmup: int) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(workers),
        "--nnodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        BASELINE,
        "--spec",
        spec_path,
        "--corpus",
        corpus,
        "--out",
        out_dir,
    ]
    env = child_env()
    env["OMP_NUM_THREADS"] = "1"  # what torchrun sets by default for nproc > 1, made explicit
    rc, wall, cpu = run_subprocess(
        cmd,
        timeout,
        env,
        os.path.join(out_dir, "log.txt"),
        is_trainer=lambda c: BASELINE in c and "torch.distributed.run" not in c,
    )
    if rc != 0:
        raise RuntimeError(f"torchrun baseline exited {rc}:\n{tail(os.path.join(out_dir, 'log.txt'))}")
    ranks = []
    for r in range(workers):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    n_steps = len(ranks[0]["steps"])
    ts = [max(rk["steps"][i]["ts"] for rk in ranks) for i in range(n_steps)]
    losses = [sum(rk["steps"][i]["local_loss"] for rk in ranks) / workers for i in range(n_steps)]
    steps = [rk_step["step"] for rk_step in ranks[0]["steps"]]
    step_times = [max(rk["steps"][i]["step_time_s"] for rk in ranks) for i in range(n_steps)]
    return _summarise(
        "torchrun", steps, ts, losses, step_times, warmup, wall, cpu, workers, extra={"threads": ranks[0]["threads"]}
    )


def run_ours(spec_path: str, run_dir: str, timeout: float, warmup: int, side: str = "ours") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_ours-child", spec_path, run_dir]
    log = run_dir + ".log"
    rc, wall, cpu = run_subprocess(
        cmd, timeout, child_env(), log, is_trainer=lambda c: c.startswith("ray::TrainWorker")
    )
    if rc != 0:
        raise RuntimeError(f"elastic run exited {rc}:\n{tail(log)}")
    from elastic.events import read_events

    events = read_events(run_dir)
    step_events = [e for e in events if e["kind"] == "step"]
    dps = {e["dp"] for e in step_events}
    resizes = [e for e in events if e["kind"] in ("failure", "resize")]
    if resizes:
        raise RuntimeError(f"the elastic run had failures or resizes, not a steady-state run: {resizes}")
    return _summarise(
        side,
        [e["step"] for e in step_events],
        [e["ts"] for e in step_events],
        [e["loss"] for e in step_events],
        [e["step_time_s"] for e in step_events],
        warmup,
        wall,
        cpu,
        max(dps),
        extra={"dp": sorted(dps)},
    )


def ours_child(spec_path: str, run_dir: str) -> None:
    """Runs in a fresh process: one ElasticTrainer.fit() on a private embedded local Ray."""
    import ray

    from elastic import ElasticTrainer
    from jobs import JobSpec

    with open(spec_path) as f:
        spec = JobSpec.from_dict(json.load(f))
    workers = spec.elastic.max_dp * spec.parallel.replica_size
    # Started here rather than by ElasticTrainer so that it can never join another
    # developer's running cluster; sized exactly as the trainer's embedded Ray would be.
    cpus = max(os.cpu_count() or 1, workers * max(int(spec.resources.cpus_per_worker), 1) + 1)
    ray.init(
        address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING
    )
    try:
        result = ElasticTrainer(spec, run_dir=run_dir, progress=False).fit()
    finally:
        ray.shutdown()
    if result is None or result.status != "succeeded":
        raise SystemExit(f"elastic run did not succeed: {result}")


def _summarise(
    side: str,
    steps: list[int],
    ts: list[float],
    losses: list,
    step_times: list[float],
    warmup: int,
    wall: float,
    cpu: TreeCPU,
    trainers: int,
    extra: dict,
) -> dict:
    window = [(s, t) for s, t in zip(steps, ts) if s > warmup]
    inside = [x for s, x in zip(steps, step_times) if s > warmup]
    n = window[-1][0] - window[0][0]
    job_cpu, trainer_cpu = cpu.cpu_between(window[0][1], window[-1][1])
    return {
        "cpu_per_step_s": trainer_cpu / n / trainers,
        "job_cpu_per_step_s": job_cpu / n,
        "side": side,
        "steps": steps,
        "ts": ts,
        "losses": losses,
        "window_steps": len(window),
        "window_s": window[-1][1] - window[0][1],
        "s_per_step": seconds_per_step(window),
        "s_per_step_robust": theil_sen(window),
        "median_step_time_s": statistics.median(inside),
        "wall_s": wall,
        "load": os.getloadavg()[0],
        **extra,
    }


# --------------------------------------------------------------------------- main


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


def main(argv: list[str] | None = None) -> int:
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
    args = ap.parse_args(argv)
    if args.steps - args.warmup < 2:
        ap.error("--steps must exceed --warmup by at least 2")

    from elastic.ingest.corpus import synthetic_corpus
    from jobs import JobSpec

    work = tempfile.mkdtemp(prefix="bench-overhead-")
    try:
        base = JobSpec.from_yaml(args.config, overrides=list(SIZES[args.size]) + list(args.set))
        m = base.model
        corpus_path = synthetic_corpus(
            os.path.join(work, "data"), base.data.num_samples, m.seq_len, m.vocab_size, base.seed
        )
        corpus_uri = "file://" + os.path.abspath(corpus_path)
        spec_dict = build_spec(args, corpus_uri)
        spec = JobSpec.from_dict(spec_dict)
        spec_path = os.path.join(work, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec_dict, f)
        nosnap_path = os.path.join(work, "spec-nosnap.json")
        with open(nosnap_path, "w") as f:
            json.dump({**spec_dict, "checkpoint": {**spec_dict["checkpoint"], "memory_every_steps": 0}}, f)
        tokens_per_step = spec.train.global_batch * spec.model.seq_len
        print(
            f"model {args.size}: {m.n_layers} layers, d_model {m.d_model}, seq_len {m.seq_len}, vocab {m.vocab_size}; "
            f"{args.workers} workers x 1 thread, global_batch {spec.train.global_batch}, micro_batch "
            f"{spec.parallel.micro_batch}, grad_accum {spec.grad_accum(args.workers)}; {args.steps} steps "
            f"(steady window: steps {args.warmup + 1}..{args.steps}), {args.reps} rep(s) each, alternating",
            flush=True,
        )

        runs: list[dict] = []
        for rep in range(args.reps):
            b = run_baseline(
                spec_path, corpus_uri, args.workers, os.path.join(work, f"torchrun-{rep}"), args.timeout, args.warmup
            )
            b["rep"] = rep
            runs.append(b)
            print(f"  rep {rep} torchrun: {tokens_per_step / b['s_per_step']:9.0f} tokens/s", flush=True)
            o = run_ours(spec_path, os.path.join(work, f"ours-{rep}"), args.timeout, args.warmup)
            o["rep"] = rep
            runs.append(o)
            print(f"  rep {rep} ours:     {tokens_per_step / o['s_per_step']:9.0f} tokens/s", flush=True)
            if args.no_snapshot_variant:
                n = run_ours(
                    nosnap_path, os.path.join(work, f"ours-nosnap-{rep}"), args.timeout, args.warmup, "ours-nosnap"
                )
                n["rep"] = rep
                runs.append(n)
                print(f"  rep {rep} ours-nosnap: {tokens_per_step / n['s_per_step']:9.0f} tokens/s", flush=True)

        for r in runs:
            r["tokens_per_s"] = tokens_per_step / r["s_per_step"]
        by_side = {s: [r for r in runs if r["side"] == s] for s in ("torchrun", "ours", "ours-nosnap")}
        by_side = {s: rs for s, rs in by_side.items() if rs}
        mean_tps = {s: statistics.fmean(r["tokens_per_s"] for r in rs) for s, rs in by_side.items()}
        pair_ratios = [o["tokens_per_s"] / b["tokens_per_s"] for b, o in zip(by_side["torchrun"], by_side["ours"])]
        ratio_of_means = mean_tps["ours"] / mean_tps["torchrun"]
        ratio = statistics.median(pair_ratios)
        # Same data, model and optimizer: the per-step losses must agree in every run (a
        # correctness check on the comparison itself, not a performance figure).
        b0, o0 = by_side["torchrun"][0], by_side["ours"][0]
        loss_diff = 0.0
        for r in runs[1:]:
            if len(r["losses"]) != len(b0["losses"]):
                raise SystemExit(
                    f"{r['side']} rep {r['rep']} ran {len(r['losses'])} steps, torchrun {len(b0['losses'])}"
                )
            for step, (x, y) in enumerate(zip(b0["losses"], r["losses"]), 1):
                if abs(x - y) > LOSS_RTOL * abs(x):
                    raise SystemExit(
                        f"losses differ at step {step}: torchrun {x!r}, {r['side']} rep {r['rep']} {y!r} "
                        f"(rel {abs(x - y) / abs(x):.1e} > {LOSS_RTOL:g}): not a like-for-like comparison"
                    )
                loss_diff = max(loss_diff, abs(x - y) / abs(x))
        cpu = {s: statistics.median(r["cpu_per_step_s"] for r in rs) for s, rs in by_side.items()}
        job_cpu = {s: statistics.median(r["job_cpu_per_step_s"] for r in rs) for s, rs in by_side.items()}
        cpu_pairs = [b["cpu_per_step_s"] / o["cpu_per_step_s"] for b, o in zip(by_side["torchrun"], by_side["ours"])]
        job_pairs = [
            b["job_cpu_per_step_s"] / o["job_cpu_per_step_s"] for b, o in zip(by_side["torchrun"], by_side["ours"])
        ]

        print()
        print(
            f"{'rep':>3}  {'side':<11} {'s/step':>8} {'tokens/s':>10} {'robust':>8} {'in-step':>8} {'cpu/step':>9} "
            f"{'job cpu':>8} {'wall s':>7} {'load':>5}  final loss"
        )
        for r in runs:
            print(
                f"{r['rep']:>3}  {r['side']:<11} {r['s_per_step']:8.4f} {r['tokens_per_s']:10.0f} "
                f"{r['s_per_step_robust']:8.4f} "
                f"{r['median_step_time_s']:8.4f} {r['cpu_per_step_s']:9.4f} {r['job_cpu_per_step_s']:8.4f} "
                f"{r['wall_s']:7.1f} "
                f"{r['load']:5.1f}  {r['losses'][-1]:.4f}"
            )
        print(
            "(s/step: least-squares slope of step completion times over the steady window, the headline figure;\n"
            " robust: Theil-Sen slope of the same points; in-step: median time inside a step as the workers measure "
            "it;\n"
            " cpu/step: CPU seconds per step of one training process (mean over them); job cpu: CPU seconds per step\n"
            " of the whole process tree; load: 1-minute load average of the machine when the run ended)"
        )
        print(
            "mean tokens/s: "
            + ", ".join(f"{s} {v:.0f}" for s, v in mean_tps.items())
            + f"; per-rep ratios ours/torchrun {', '.join(f'{x:.3f}' for x in pair_ratios)}"
        )
        if "ours-nosnap" in mean_tps:
            print(
                f"ratio ours-nosnap/torchrun = {mean_tps['ours-nosnap'] / mean_tps['torchrun']:.2f} "
                f"(memory snapshots off: what the per-step snapshot costs)"
            )
        short = [r for r in runs if r["side"].startswith("ours") and r["window_s"] < MIN_WINDOW_S]
        if short:
            print(
                f"warning: a steady window of ours lasted {min(r['window_s'] for r in short):.1f} s, under "
                f"{MIN_WINDOW_S:g} s: "
                f"a slope over so short a window is noisy, so such a short "
                f"window mis-measures ours; use more --steps or a larger --size"
            )
        cores = os.cpu_count() or 1
        busy = max(r["load"] for r in runs)
        if busy > cores:
            print(
                f"note: the machine was busy (1-minute load up to {busy:.1f} on {cores} cores, from other users): "
                f"the ratios of this run carry that noise"
            )
        print(
            f"losses agree: max relative difference over {len(o0['losses'])} steps and every run {loss_diff:.1e} "
            f"(asserted <= {LOSS_RTOL:g})"
        )
        print(
            f"cpu ratio torchrun/ours (training processes) = {statistics.median(cpu_pairs):.3f} "
            f"(per rep {', '.join(f'{x:.3f}' for x in cpu_pairs)}); (whole job) = {statistics.median(job_pairs):.3f} "
            f"(per rep {', '.join(f'{x:.3f}' for x in job_pairs)})"
        )
        print(
            f"ratio of mean tokens/s ours/torchrun = {ratio_of_means:.2f}; median of the per-rep paired ratios follows"
        )
        print(f"ratio ours/torchrun = {ratio:.2f} (goal >= 0.97)")

        if args.json:
            out = {
                "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "host": os.uname().nodename,
                "cores": os.cpu_count(),
                "workers": args.workers,
                "steps": args.steps,
                "warmup": args.warmup,
                "reps": args.reps,
                "size": args.size,
                "global_batch": spec.train.global_batch,
                "micro_batch": spec.parallel.micro_batch,
                "grad_accum": spec.grad_accum(args.workers),
                "tokens_per_step": tokens_per_step,
                "runs": [
                    {
                        k: r[k]
                        for k in (
                            "rep",
                            "side",
                            "s_per_step",
                            "tokens_per_s",
                            "s_per_step_robust",
                            "median_step_time_s",
                            "wall_s",
                            "load",
                            "window_steps",
                            "window_s",
                            "cpu_per_step_s",
                            "job_cpu_per_step_s",
                        )
                    }
                    | {"final_loss": r["losses"][-1]}
                    for r in runs
                ],
                "mean_tokens_per_s": mean_tps,
                "pair_ratios": pair_ratios,
                "ratio": ratio,
                "ratio_of_means": ratio_of_means,
                "goal": 0.97,
                "ratio_definition": "median over reps of tokens/s(ours) / tokens/s(torchrun) of the same rep",
                "max_loss_rel_diff": loss_diff,
                "cpu_per_step_s": cpu,
                "job_cpu_per_step_s": job_cpu,
                "cpu_pair_ratios": cpu_pairs,
                "job_cpu_pair_ratios": job_pairs,
            }
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
                f.write("\n")
        return 0
    finally:
        if args.keep:
            print(f"working directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_ours-child":
        ours_child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
