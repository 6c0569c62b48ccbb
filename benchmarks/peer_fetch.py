"""A peer's memory snapshot fetched by a rank on another node: over one TCP connection
(``elastic.checkpoint.snapshot_stream``, the product) vs through Ray's object store (the
path of before, as an expert would use it: the snapshot as numpy byte arrays, which Ray
serialises out of band and the receiver maps without a copy: ``Snapshot.to_wire``).

A local 2-node ``ray.cluster_utils.Cluster`` (each node its own raylet and object store, on
this one host): a holder actor on node 1 keeps a snapshot of ``--sizes-mb`` (fp32 tensors
of 4 MB, as a model's are many), a fetcher actor on node 2 takes it whole, each side in
turn (alternating repetition by repetition), and times from the request to a ``Snapshot``
in hand (``fetch_s``), checking its bytes against the holder's checksum. A restore then
copies it into the model either way, which is not timed. Printed: median and range per
side and size, MB/s, the ratio object store / stream, the machine's load.

Usage::

    .venv/bin/python -m benchmarks.peer_fetch [--sizes-mb 64,512,1228] [--reps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks.harness.results import machine, utc_stamp, write_json
from benchmarks.harness.stats import median_range

SIDES = ("stream", "object_store")
TENSOR_MB = 4
TIMEOUT_S = 600.0


def _snapshot(size_mb: int) -> Any:
    import torch

    from elastic.checkpoint.snapshot import Snapshot

    n = max(1, size_mb // TENSOR_MB)
    g = torch.Generator().manual_seed(size_mb)
    tensors = {f"app/model/t{i}": torch.randn(TENSOR_MB << 18, generator=g) for i in range(n)}
    return Snapshot(1, 0, tensors, {"step": 1}, {"dp": 2}, complete=True)


def _checksum(snap: Any) -> float:
    return float(sum(float(t.double().sum()) for t in snap.tensors.values()))


class Holder:
    def __init__(self) -> None:
        self.snaps: dict[int, Any] = {}

    def hold(self, size_mb: int) -> float:
        self.snaps = {size_mb: _snapshot(size_mb)}
        return _checksum(self.snaps[size_mb])

    def wire(self, size_mb: int) -> dict[str, Any]:
        return self.snaps[size_mb].to_wire()

    def offer(self, size_mb: int) -> dict[str, Any]:
        import ray

        from elastic.checkpoint.snapshot_stream import offer

        return offer(self.snaps[size_mb], ray.util.get_node_ip_address(), TIMEOUT_S)


class Fetcher:
    def fetch(self, holder: Any, size_mb: int, side: str) -> dict[str, float]:
        import ray

        from elastic.checkpoint.snapshot import Snapshot
        from elastic.checkpoint.snapshot_stream import receive

        t0 = time.perf_counter()
        if side == "stream":
            snap = receive(ray.get(holder.offer.remote(size_mb), timeout=TIMEOUT_S), TIMEOUT_S)
        else:
            snap = Snapshot.from_wire(ray.get(holder.wire.remote(size_mb), timeout=TIMEOUT_S))
        took = time.perf_counter() - t0
        return {"fetch_s": took, "checksum": _checksum(snap), "bytes": float(snap.nbytes)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="64,512,1228", help="snapshot sizes in MB, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="fetches per side and size")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes_mb.split(",") if x]
    except ValueError:
        ap.error("--sizes-mb: comma-separated whole numbers of MB")
    if not sizes or min(sizes) < TENSOR_MB:
        ap.error(f"--sizes-mb: each at least {TENSOR_MB}")
    if args.reps < 1:
        ap.error("--reps: must be at least 1")
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from benchmarks.harness.cluster import local_cluster

    load = [os.getloadavg()[0]]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {str(s): {side: [] for side in SIDES} for s in sizes}
    with local_cluster(2, node_cpus=1, dashboard=False):
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]

        def on(node: str) -> dict[str, Any]:
            return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

        holder = ray.remote(Holder).options(**on(nodes[0])).remote()
        fetcher = ray.remote(Fetcher).options(**on(nodes[1])).remote()
        for size in sizes:
            want = ray.get(holder.hold.remote(size), timeout=TIMEOUT_S)
            for rep in range(args.reps):
                for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                    got = ray.get(fetcher.fetch.remote(holder, size, side), timeout=TIMEOUT_S)
                    if abs(got["checksum"] - want) > 1e-6 * max(1.0, abs(want)):
                        raise SystemExit(f"{side} at {size} MB: the fetched snapshot differs from the held one")
                    runs[str(size)][side].append(got)
                    mbps = got["bytes"] / got["fetch_s"] / 1e6
                    print(f"  {size:>5} MB rep {rep} {side:>12}: {got['fetch_s']:.2f} s ({mbps:.0f} MB/s)", flush=True)
                load.append(os.getloadavg()[0])
    summary: dict[str, Any] = {}
    print(f"peer snapshot fetch between 2 nodes of a local cluster, {args.reps} per side and size:")
    for size in sizes:
        by = {side: median_range(r["fetch_s"] for r in runs[str(size)][side]) for side in SIDES}
        ratio = by["object_store"]["median"] / by["stream"]["median"]
        summary[str(size)] = {"fetch_s": by, "object_store_over_stream": round(ratio, 2)}
        parts = [f"{side} {by[side]['median']:.2f} s [{by[side]['min']:.2f}, {by[side]['max']:.2f}]" for side in SIDES]
        print(f"  {size:>5} MB: {', '.join(parts)}: object store / stream {ratio:.2f}x")
    print(f"load (1 min) before and after each repetition: {[round(x, 2) for x in load]}")
    if args.json:
        doc = {"sizes_mb": sizes, "reps": args.reps, "summary": summary, "runs": runs, "load_1min": load}
        write_json(args.json, {**doc, "date_utc": utc_stamp(), "machine": machine()})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
