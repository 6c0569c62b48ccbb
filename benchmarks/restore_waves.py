"""Checkpoint restore from S3 in waves against an unstaggered restore, counted at the server.

Setup: 4 gloo ranks (FSDP, ``zero: 3``: every rank reads its own shard of a small GPT from
storage), each on its own pretend host. A moto S3 server on loopback, behind the counting
proxy (``elastic/testing/s3proxy.py``) that holds each GET ``--get-latency`` seconds like
an object store's time to first byte. Each run saves step 3 through the storage tier, then
every rank restores it into a fresh engine with ``load_from_storage`` (the code the workers
run). The proxy counts the GETs in flight during the restore window (from the barrier
before it to the last rank's end). Side by side in one run:

- ``unstaggered``: ``waves: 1``, no per-host cap (every reader at once);
- ``waves_2``: ``waves: 2, max_reads_per_host: 1`` (bound ceil(4/2) * 1 = 2);
- ``waves_4``: ``waves: 4, max_reads_per_host: 1`` (bound 1).

``--repeats`` runs each, interleaved; median and range of the peak and of the restore time.

    python -m benchmarks.restore_waves [--repeats 3] [--get-latency 0.05]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile

from benchmarks.harness.results import measured_now, results_path, write_json
from benchmarks.harness.s3 import MotoS3
from benchmarks.harness.stats import summary_with_runs

WORLD, HOSTS = 4, 4
CONFIGS = {"unstaggered": (1, 0), "waves_2": (2, 1), "waves_4": (4, 1)}


def measure(proxy, repeats: int) -> dict[str, dict[str, list]]:
    """``repeats`` restores of each configuration, interleaved: peak GETs in flight, restore
    time and GETs, counted at the proxy over the restore window."""
    from elastic.testing import checkpoint_ranks
    from elastic.testing.ranks import run_ranks

    runs: dict[str, dict[str, list]] = {name: {"peak": [], "restore_s": [], "gets": []} for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="restore-waves-") as tmp:
        for i in range(repeats):
            for name, (waves, cap) in CONFIGS.items():
                root = f"s3://bench/ckpt-{name}-{i}"
                ranks = run_ranks(
                    WORLD,
                    checkpoint_ranks.staggered_restore,
                    (root, 3, waves, cap, HOSTS),
                    os.path.join(tmp, f"{name}-{i}"),
                )
                assert all(r["diff"] == [] for r in ranks), "restored state differs"
                t0 = min(r["stats"]["window"][0] for r in ranks)
                t1 = max(r["stats"]["window"][1] for r in ranks)
                gets = sum(1 for t, _ in proxy.events if t0 <= t <= t1) // 2
                runs[name]["peak"].append(proxy.peak(t0, t1))
                runs[name]["restore_s"].append(t1 - t0)
                runs[name]["gets"].append(gets)
                print(f"[{name}] run {i}: peak {proxy.peak(t0, t1)} GETs in flight, {gets} GETs, "
                      f"restore {t1 - t0:.2f}s", flush=True)  # fmt: skip
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--get-latency", type=float, default=0.05)
    ap.add_argument("--out", default=results_path("restore_waves.json"))
    args = ap.parse_args(argv)
    from elastic.testing.s3proxy import CountingProxy

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = MotoS3("bench")
    proxy = CountingProxy(server.endpoint, prefix="/bench/", get_latency_s=args.get_latency)
    os.environ.update(MotoS3.environ(proxy.endpoint))
    results = {
        **measured_now(),
        "load_avg_at_start": os.getloadavg(),
        "note": "2-core machine shared with other jobs (load average above); timings are noisy",
        "setup": {"ranks": WORLD, "hosts": HOSTS, "zero": 3, "get_latency_s": args.get_latency},
        "configs": {},
    }
    try:
        runs = measure(proxy, args.repeats)
    finally:
        proxy.close()
        server.stop()
    for name, (waves, cap) in CONFIGS.items():
        bound = math.ceil(HOSTS / waves) * cap if cap else None
        results["configs"][name] = {
            "waves": waves,
            "max_reads_per_host": cap or None,
            "bound": bound,
            "peak_gets_in_flight": summary_with_runs(runs[name]["peak"]),
            "restore_s": summary_with_runs(runs[name]["restore_s"]),
            "gets": summary_with_runs(runs[name]["gets"]),
        }
    results["load_avg_at_end"] = os.getloadavg()
    write_json(args.out, results, newline=False)
    print(json.dumps(results["configs"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
