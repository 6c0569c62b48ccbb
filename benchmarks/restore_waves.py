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

    python benchmarks/restore_waves.py [--repeats 3] [--get-latency 0.05]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import socket
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "checkpoint"))

WORLD, HOSTS = 4, 4
CONFIGS = {"unstaggered": (1, 0), "waves_2": (2, 1), "waves_4": (4, 1)}


def _summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--get-latency", type=float, default=0.05)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "restore_waves.json"))
    args = ap.parse_args()
    import boto3
    import ckpt_gloo_workers
    from moto.server import ThreadedMotoServer

    from elastic.testing.ranks import run_ranks
    from elastic.testing.s3proxy import CountingProxy

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    upstream = f"http://127.0.0.1:{port}"
    boto3.client(
        "s3",
        endpoint_url=upstream,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket="bench")
    proxy = CountingProxy(upstream, prefix="/bench/", get_latency_s=args.get_latency)
    os.environ.update(
        AWS_ENDPOINT_URL=proxy.endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    results = {
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "note": "2-core machine shared with other jobs (load average above); timings are noisy",
        "setup": {"ranks": WORLD, "hosts": HOSTS, "zero": 3, "get_latency_s": args.get_latency},
        "configs": {},
    }
    runs = {name: {"peak": [], "restore_s": [], "gets": []} for name in CONFIGS}
    try:
        with tempfile.TemporaryDirectory(prefix="restore-waves-") as tmp:
            for i in range(args.repeats):
                for name, (waves, cap) in CONFIGS.items():
                    root = f"s3://bench/ckpt-{name}-{i}"
                    ranks = run_ranks(
                        WORLD,
                        ckpt_gloo_workers.staggered_restore,
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
    finally:
        proxy.close()
        server.stop()
    for name, (waves, cap) in CONFIGS.items():
        bound = math.ceil(HOSTS / waves) * cap if cap else None
        results["configs"][name] = {
            "waves": waves,
            "max_reads_per_host": cap or None,
            "bound": bound,
            "peak_gets_in_flight": _summary(runs[name]["peak"]),
            "restore_s": _summary(runs[name]["restore_s"]),
            "gets": _summary(runs[name]["gets"]),
        }
    results["load_avg_at_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results["configs"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
