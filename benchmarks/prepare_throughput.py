"""``elastic prepare`` throughput against a plain single-process loop, side by side (issue 13).

Input: JSON lines of the Python standard library's sources (text on every machine), about
1 MB per file, at several sizes. Both sides use the same tokenizer (Hugging Face
``tokenizers``, byte-level, ``encode_batch``; it runs on all cores through its own thread
pool in the plain loop too), the same packing code and write the same shards to local disk.
The plain loop is the baseline of ``benchmarks/data_ingest.py`` too
(``benchmarks/harness/plain_prepare.py``): read, tokenize 64 documents at a time, pack,
write. ``prepare`` runs on a fresh local Ray (``--cpus``). Its first run in that Ray is
reported apart: it pays the worker processes' start and imports. Then ``--repeats`` runs of
each side, alternating; median and range of tokens/s.

    python -m benchmarks.prepare_throughput [--sizes-mb 2,16] [--repeats 3] [--cpus 2]
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time

from benchmarks.harness.plain_prepare import plain_loop
from benchmarks.harness.results import measured_now, results_path, write_json
from benchmarks.harness.stats import summary_with_runs


def make_input(path: str, megabytes: float) -> int:
    """About ``megabytes`` MB of stdlib sources as JSON lines, ~1 MB per file; returns bytes."""
    os.makedirs(path)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    total, k, out = 0, 0, None
    for src in files:
        if total >= megabytes * 1e6:
            break
        if out is None or out.tell() > 1e6:
            if out is not None:
                out.close()
            out = open(os.path.join(path, f"docs-{k:04d}.jsonl"), "w")
            k += 1
        text = open(src, encoding="utf-8", errors="replace").read()
        out.write(json.dumps({"text": text}) + "\n")
        total += len(text)
    out.close()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="2,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=results_path("prepare_throughput.json"))
    args = ap.parse_args(argv)
    import ray

    from elastic.ingest.prepare import PrepareConfig, prepare

    tmp = tempfile.mkdtemp(prefix="prepare-bench-")
    results = {
        **measured_now(),
        "ray_cpus": args.cpus,
        "load_avg_at_start": os.getloadavg(),
        "note": "2-core machine shared with other jobs (load average above); timings are noisy",
        "sizes": {},
    }
    ray.init(
        address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR
    )
    try:
        for mb in [float(x) for x in args.sizes_mb.split(",")]:
            text = os.path.join(tmp, f"text-{mb:g}")
            chars = make_input(text, mb)
            cold = prepare(PrepareConfig(text, os.path.join(tmp, "cold"), tokenizer="byte", seq_len=64, progress=False))
            shutil.rmtree(os.path.join(tmp, "cold"))
            ours, base = [], []
            for i in range(args.repeats):
                d = os.path.join(tmp, f"prep-{i}")
                r = prepare(PrepareConfig(text, d, tokenizer="byte", seq_len=64, progress=False))
                ours.append(r.tokens_per_s)
                t0 = time.perf_counter()
                base.append(plain_loop(text, "byte", os.path.join(tmp, f"loop-{i}"), 64, 2048))
                print(f"[{mb:g} MB] run {i}: prepare {ours[-1]:,.0f} tokens/s, plain loop {base[-1]:,.0f} tokens/s "
                      f"({time.perf_counter() - t0:.1f}s)", flush=True)  # fmt: skip
                shutil.rmtree(d, ignore_errors=True)
                shutil.rmtree(os.path.join(tmp, f"loop-{i}"), ignore_errors=True)
            results["sizes"][f"{mb:g}MB"] = {
                "chars": chars,
                "tokens": r.tokens,
                "prepare_first_run_tokens_per_s": cold.tokens_per_s,
                "prepare_tokens_per_s": summary_with_runs(ours),
                "plain_loop_tokens_per_s": summary_with_runs(base),
                "ratio_median": statistics.median(ours) / statistics.median(base),
            }
            print(json.dumps({f"{mb:g}MB": results["sizes"][f"{mb:g}MB"]}, indent=1), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_avg_at_end"] = os.getloadavg()
    write_json(args.out, results, newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
