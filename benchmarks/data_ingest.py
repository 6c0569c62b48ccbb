"""Data ingest, measured side by side with its baselines (issue 13; see docs/data.md).

1. **Storage burst**: a 4-node ``ray.cluster_utils.Cluster`` (a CPU-less head and four 1-CPU
   nodes) trains from ``s3://`` on a real S3 server (moto) on loopback, through a counting
   proxy that sees every GET at the server side. A node is killed at step 8. Peak GETs in
   flight at start-up (to the job's start) and after the node loss (from the driver's
   quiesce of the survivors' readers to the new layout's first windows: the windows of
   ``elastic.testing.read_windows``), with ``data.waves: 4`` against ``data.waves: 1``; the
   bound is ``ceil(hosts / waves) * max_reads_per_host``. The gap from the loss's detection
   to the quiesce, where the paused readers finish the GETs they had begun, is reported
   beside them.
2. **Data wait**: the quickstart model from ``s3://`` at dp 4; steady state (steps after the
   first 5): sum of ``data_wait_s`` over sum of ``step_time_s``, ray_data (the default) and
   feeder against the native reader; and each one's start-up (job start to first step).
3. **Prepare throughput**: ``elastic prepare`` on the cluster against a plain single-process
   loop (read, ``encode_batch`` with the same tokenizer, pack, write the same shards) on the
   same input; tokens/s, 3 runs each, median and range.
4. **Duplicate reads**: bytes GET from storage per step with tp=2 against tp=1 (dp 2 both),
   for the default loader (``ray_data``) and ``feeder``, and the native reader at tp=2 for contrast.

Usage: ``python -m benchmarks.data_ingest [--out benchmarks/results/data_ingest.json] [--only 1,2,3,4]``
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from benchmarks.harness.cluster import local_cluster
from benchmarks.harness.plain_prepare import plain_loop
from benchmarks.harness.results import measured_now, results_path, write_json
from benchmarks.harness.s3 import MotoS3
from benchmarks.harness.stats import summary_with_runs

GET_LATENCY_S = 0.05  # the proxy holds each data GET this long: an object store's time to first byte


@dataclass(frozen=True)
class Scale:
    """How much each part runs: the published run's, or ``--smoke``'s (the test suite's: every
    part through every phase, at sizes whose figures mean nothing)."""

    packages: tuple[str, ...] = ("json", "email", "http", "logging", "asyncio", "xml/dom", "unittest")
    burst_waves: tuple[int, ...] = (4, 1)
    burst_steps: int = 20
    burst_kill_step: int = 8
    wait_warm_job: bool = True
    wait_steps: int = 60
    wait_model: tuple[int, int, int] = (4, 128, 512)  # n_layers, d_model, vocab_size
    prepare_repeats: int = 3
    dup_steps: int = 40


FULL = Scale()
SMOKE = Scale(
    packages=("json",),
    burst_waves=(4,),
    burst_steps=8,
    burst_kill_step=3,
    wait_warm_job=False,
    wait_steps=8,
    wait_model=(2, 32, 257),
    prepare_repeats=1,
    dup_steps=4,
)


def make_text(tmp: str, packages) -> str:
    from elastic.testing.texts import stdlib_texts, write_jsonl

    path = os.path.join(tmp, "text")
    write_jsonl(path, stdlib_texts(packages), per_file=16)
    return path


def cluster(nodes: int = 4):
    """A CPU-less head and ``nodes`` one-CPU nodes, Ray's dashboard off."""
    return local_cluster(nodes, dashboard=False, log_level=logging.ERROR)


def spec(source, options, **over):
    from jobs import JobSpec

    raw = {
        "name": "ingest-bench",
        "seed": 1,
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 257, "seq_len": 64},
        "data": {"source": source, "storage_options": options, "max_reads_per_host": 2},
        "parallel": {"micro_batch": 1},
        "elastic": {"min_dp": 1, "max_dp": 4, "heartbeat_timeout_s": 5, "collective_timeout_s": 15},
        "train": {"steps": 20, "global_batch": 12, "lr": 3.0e-3},
        "checkpoint": {"every_steps": 0, "memory_every_steps": 1},
    }
    for k, v in over.items():
        sect, key = k.split("__")
        raw[sect][key] = v
    return JobSpec.from_dict(raw)


def events(run_dir):
    from elastic.events import read_events

    return read_events(run_dir)


# --------------------------------------------------------------------------- 1. burst
def storage_burst(moto, corpus, tmp, scale: Scale = FULL):
    from elastic import ElasticTrainer
    from elastic.faults import Fault, FaultInjector, WorkerFaults, worker_fault
    from elastic.testing.read_windows import QuiesceClock, recovery_window, startup_window
    from elastic.testing.s3proxy import CountingProxy

    out = {}
    for waves in scale.burst_waves:
        proxy = CountingProxy(moto.endpoint, prefix="/bench/corpus", get_latency_s=GET_LATENCY_S)
        try:
            with cluster(4) as c:
                t_start = time.time()
                s = spec(corpus, moto.options(proxy.endpoint), data__waves=waves, train__steps=scale.burst_steps)
                inj = FaultInjector([Fault("kill_node", at_step=scale.burst_kill_step, node_index=2)], cluster=c)
                slow = [worker_fault("slow", step=1, rank=r, seconds=0.1) for r in range(4)]
                run_dir = os.path.join(tmp, f"burst-w{waves}")
                with QuiesceClock() as quiesces:
                    ElasticTrainer(s, run_dir=run_dir, callbacks=[inj], step_hook=WorkerFaults(slow)).fit()
        finally:
            proxy.close()
        evs = events(run_dir)
        t_fail = next(e["ts"] for e in evs if e["kind"] == "failure")
        startup, recovery = startup_window(evs, t_start), recovery_window(evs, quiesces.spans)
        per_host = s.data.max_reads_per_host
        out[f"waves_{waves}"] = {
            "startup_peak_gets": proxy.peak(*startup),
            "after_node_loss_peak_gets": proxy.peak(*recovery),
            "detection_to_quiesce_s": recovery[0] - t_fail,
            "detection_to_quiesce_peak_gets": proxy.peak(t_fail, recovery[0]),
            "whole_run_peak_gets": proxy.peak(),
            "get_latency_s": GET_LATENCY_S,
            "bound_startup": math.ceil(4 / waves) * per_host,
            "bound_after_loss": math.ceil(3 / min(waves, 3)) * per_host,
            "gets": proxy.gets,
            "startup_s": next(e["ts"] for e in evs if e["kind"] == "step") - t_start,
        }
        print(f"[burst] waves={waves}: {out[f'waves_{waves}']}", flush=True)
    return out


# --------------------------------------------------------------------------- 2. data wait
def data_wait(moto, corpus, tmp, scale: Scale = FULL):
    from elastic import ElasticTrainer

    out = {}
    with cluster(4):
        # An untimed job first: the cluster's first job starts worker processes and Ray's
        # own actors for all that follow, and must not be charged to the first loader.
        if scale.wait_warm_job:
            ElasticTrainer(
                spec(corpus, moto.options(), data__loader="native", train__steps=3), run_dir=os.path.join(tmp, "warm")
            ).fit()
        layers, width, vocab = scale.wait_model
        for loader in ("ray_data", "feeder", "native"):
            s = spec(
                corpus,
                moto.options(),
                model__n_layers=layers,
                model__d_model=width,
                model__vocab_size=vocab,
                parallel__micro_batch=4,
                train__global_batch=48,
                train__steps=scale.wait_steps,
                data__loader=loader,
            )
            run_dir = os.path.join(tmp, f"wait-{loader}")
            t_start = time.time()
            try:
                ElasticTrainer(s, run_dir=run_dir).fit()
            except Exception as exc:  # noqa: BLE001 - a loader that cannot start is a result too
                out[loader] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}", "after_s": time.time() - t_start}
                print(f"[wait] {loader}: {out[loader]}", flush=True)
                continue
            first = next(e["ts"] for e in events(run_dir) if e["kind"] == "step")
            steps = [e for e in events(run_dir) if e["kind"] == "step"][5:]
            waits = [e["data_wait_s"] for e in steps]
            times = [e["step_time_s"] for e in steps]
            out[loader] = {
                "steady_steps": len(steps),
                "wait_fraction": sum(waits) / sum(times),
                "median_wait_s": statistics.median(waits),
                "max_wait_s": max(waits),
                "median_step_s": statistics.median(times),
                "first_step_after_s": first - t_start,  # start-up: cluster join, build, first reads
            }
            print(f"[wait] {loader}: {out[loader]}", flush=True)
    return out


# --------------------------------------------------------------------------- 3. prepare
def prepare_throughput(text_dir, tmp, repeats=3):
    from elastic.ingest.prepare import PrepareConfig, prepare

    out = {}
    with cluster(4):
        bpe_dir = os.path.join(tmp, "bpe-train")
        prepare(PrepareConfig(text_dir, bpe_dir, tokenizer="bpe:2048", seq_len=64, progress=False))
        for name, tok in (("byte", "byte"), ("bpe2048", os.path.join(bpe_dir, "tokenizer.json"))):
            ours, base = [], []
            for i in range(repeats):
                d = os.path.join(tmp, f"prep-{name}-{i}")
                r = prepare(PrepareConfig(text_dir, d, tokenizer=tok, seq_len=64, progress=False))
                ours.append(r.tokens_per_s)
                base.append(plain_loop(text_dir, tok, os.path.join(tmp, f"loop-{name}-{i}"), 64, 2048))
                shutil.rmtree(d, ignore_errors=True)
            out[name] = {
                "prepare_tokens_per_s": summary_with_runs(ours),
                "plain_loop_tokens_per_s": summary_with_runs(base),
                "ratio_median": statistics.median(ours) / statistics.median(base),
                "tokens": r.tokens,
            }
            print(f"[prepare] {name}: {out[name]}", flush=True)
    return out


# --------------------------------------------------------------------------- 4. duplicate reads
def duplicate_reads(moto, corpus, tmp, scale: Scale = FULL):
    from elastic import ElasticTrainer
    from elastic.testing.s3proxy import CountingProxy

    out = {}
    with cluster(4):
        for name, tp, loader in (
            ("tp1_ray_data", 1, "ray_data"),
            ("tp2_ray_data", 2, "ray_data"),
            ("tp1_feeder", 1, "feeder"),
            ("tp2_feeder", 2, "feeder"),
            ("tp2_native", 2, "native"),
        ):
            proxy = CountingProxy(moto.endpoint, prefix="/bench/corpus")
            s = spec(
                corpus,
                moto.options(proxy.endpoint),
                parallel__tp=tp,
                elastic__min_dp=2,
                elastic__max_dp=2,
                data__loader=loader,
                train__steps=scale.dup_steps,
            )
            run_dir = os.path.join(tmp, f"dup-{name}")
            ElasticTrainer(s, run_dir=run_dir).fit()
            proxy.close()
            gets, nbytes = proxy.counts()
            out[name] = {"bytes_per_step": nbytes / s.train.steps, "gets": gets, "bytes": nbytes}
            print(f"[dup] {name}: {out[name]}", flush=True)
    out["ratio_tp2_over_tp1"] = out["tp2_ray_data"]["bytes"] / out["tp1_ray_data"]["bytes"]  # the default loader
    out["ratio_tp2_over_tp1_feeder"] = out["tp2_feeder"]["bytes"] / out["tp1_feeder"]["bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=results_path("data_ingest.json"))
    ap.add_argument("--only", default="1,2,3,4")
    ap.add_argument("--smoke", action="store_true", help="every part at its smallest (the test suite's run)")
    args = ap.parse_args(argv)
    scale = SMOKE if args.smoke else FULL
    parts = set(args.only.split(","))
    logging.getLogger("ray").setLevel(logging.ERROR)
    from elastic.ingest.prepare import PrepareConfig, prepare

    tmp = tempfile.mkdtemp(prefix="data-ingest-")
    results = {
        **measured_now(),
        "load_before": os.getloadavg(),
        "scale": {"smoke": args.smoke, **asdict(scale)},
    }
    moto = MotoS3("bench")
    try:
        text = make_text(tmp, scale.packages)
        for name in sorted(os.listdir(text)):
            moto.client.upload_file(os.path.join(text, name), "bench", f"text/{name}")
        corpus = "s3://bench/corpus"
        os.environ.update(MotoS3.environ(moto.endpoint))
        with cluster(4):
            r = prepare(PrepareConfig("s3://bench/text", corpus, tokenizer="byte", seq_len=64, rows_per_shard=256))
            results["corpus"] = {"rows": r.rows, "shards": r.shards, "tokens": r.tokens}
        run_parts(parts, results, moto, corpus, text, tmp, scale)
    finally:
        moto.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    # a partial run updates its parts only
    if parts != {"1", "2", "3", "4"} and not args.smoke and os.path.exists(args.out):
        with open(args.out) as f:
            previous = json.load(f)
        for key in PARTS.values():
            if key in previous and key not in results:
                results[key] = previous[key]
    write_json(args.out, results, newline=False)
    print(json.dumps(results, indent=2))
    return 0


PARTS = {"1": "storage_burst", "2": "data_wait", "3": "prepare_throughput", "4": "duplicate_reads"}


def run_parts(parts: set[str], results: dict, moto: MotoS3, corpus: str, text: str, tmp: str, scale: Scale) -> None:
    if "1" in parts:
        results["storage_burst"] = storage_burst(moto, corpus, tmp, scale)
    if "2" in parts:
        results["data_wait"] = data_wait(moto, corpus, tmp, scale)
    if "3" in parts:
        results["prepare_throughput"] = prepare_throughput(text, tmp, scale.prepare_repeats)
    if "4" in parts:
        results["duplicate_reads"] = duplicate_reads(moto, corpus, tmp, scale)


if __name__ == "__main__":
    sys.exit(main())
