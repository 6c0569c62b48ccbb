"""Bytes read from storage per host, at 4 and 8 hosts: host readers that fetch only the row
groups their replicas consume and those groups' own metadata (a version 3 index: row-group
sidecars), against the same shards under a version 2 index (the same row groups, after the
footer of every shard a host's stream reaches) and a version 1 index (every host reads every
shard whole). See docs/data.md.

Setup: a moto S3 server on loopback behind the counting proxy (``elastic/testing/s3proxy.py``),
which counts every GET and its bytes at the server side. ``elastic prepare`` makes the corpus
on ``s3://`` from stdlib sources (byte tokenizer); the version 2 and version 1 twins are the
same shard objects copied (without the sidecars) under the index an older ``elastic prepare``
wrote (``CorpusIndex.as_version``). For each host count, a local
multi-node Ray cluster (``ray.cluster_utils.Cluster``: a CPU-less head and one node per host)
runs the product's own pieces: the driver's ``HostReaders.plans`` makes one ``HostFeeder``
actor per host, pinned to its node (one replica per host, so dp = hosts), and each DP rank's
own reading code (``FeederSource.open`` and ``feeder_batches``, what a rank runs) is called
from this process, one thread per rank, for ``--batches`` batches. The rows of every rank and
batch are hashed and must be the same under the three indexes.

Per configuration: each host's bytes read (index, metadata: footers or sidecar records,
data; the feeders' own counters),
the bytes the server sent them (the proxy's count, less the driver's one look at the index;
a difference from the feeders' sum is reported as ``unattributed_bytes``), and the ratio of
the bytes the server sent to the bytes consumed: the bytes of the row groups that hold the
consumed rows, each counted once (what one reader of exactly those rows would fetch,
metadata aside).

    python -m benchmarks.data_bytes_per_host [--hosts 4,8] [--batches 96] [--global-batch 64]
        [--seq-len 1023] [--rows-per-shard 256] [--rows-per-group 8] [--engine ray_data|threads]
        [--out FILE] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.harness.cluster import local_cluster, local_ray
from benchmarks.harness.results import measured_now, results_path, write_json
from benchmarks.harness.s3 import MotoS3

TEXT_PACKAGES = (
    "asyncio",
    "email",
    "http",
    "idlelib",
    "importlib",
    "json",
    "logging",
    "multiprocessing",
    "pydoc_data",
    "tkinter",
    "unittest",
    "urllib",
)


CORPORA = ("v3", "v2", "v1")  # s3://bench/<name>: the index versions measured, side by side


def make_corpus(moto: MotoS3, tmp: str, args: argparse.Namespace) -> dict[str, Any]:
    """``s3://bench/v3`` (prepared), ``s3://bench/v2`` and ``s3://bench/v1`` (the same shards
    under older indexes, without the sidecars)."""
    from elastic.ingest.index import read_index, write_index
    from elastic.ingest.prepare import PrepareConfig, prepare
    from elastic.testing.texts import stdlib_texts, write_jsonl

    text = os.path.join(tmp, "text")
    write_jsonl(text, stdlib_texts(TEXT_PACKAGES), per_file=16)
    opts = moto.options()
    cfg = PrepareConfig(text, "s3://bench/v3", tokenizer="byte", seq_len=args.seq_len, progress=False)
    cfg.rows_per_shard, cfg.rows_per_group, cfg.storage_options = args.rows_per_shard, args.rows_per_group, opts
    with local_ray(2, log_level=logging.ERROR):
        result = prepare(cfg)
    index = read_index("s3://bench/v3", opts)
    if index is None or index.version != 3:
        raise RuntimeError("elastic prepare did not write a version 3 index")
    for version in (2, 1):
        for shard in index.shards:
            moto.client.copy_object(Bucket="bench", Key=f"v{version}/{shard.path}", CopySource=f"bench/v3/{shard.path}")
        write_index(f"s3://bench/v{version}", index.as_version(version), opts)
    index_bytes = {
        c: len(moto.client.get_object(Bucket="bench", Key=f"{c}/index.json")["Body"].read()) for c in CORPORA
    }
    data_bytes = sum(s.bytes - (s.footer_bytes or 0) for s in index.shards)
    groups = sum(s.groups for s in index.shards)
    return {
        "rows": result.rows,
        "shards": len(index.shards),
        "row_width": args.seq_len + 1,
        "rows_per_shard": args.rows_per_shard,
        "rows_per_group": args.rows_per_group,
        "bytes": sum(s.bytes for s in index.shards),
        "footer_bytes": sum(s.footer_bytes or 0 for s in index.shards),
        "stored_bytes_per_row": data_bytes / result.rows,
        "footer_bytes_per_group": sum(s.footer_bytes or 0 for s in index.shards) / groups,
        "sidecar_bytes": sum(s.groups_bytes or 0 for s in index.shards),
        "record_bytes": max(s.groups_record_bytes or 0 for s in index.shards),  # W: a group's metadata in v3
        "index_bytes": index_bytes,
        "index_bytes_per_shard": {c: n / len(index.shards) for c, n in index_bytes.items()},
    }


def consumed_bytes(moto: MotoS3, start_row: int, end_row: int) -> int:
    """Bytes of the row groups (each once, along the stream) that hold rows ``[start, end)``."""
    import pyarrow.parquet as pq
    import s3fs

    from elastic.ingest.index import read_index
    from elastic.ingest.shard_format import group_span
    from elastic.ingest.units import UnitTable

    opts = moto.options()
    index = read_index("s3://bench/v3", opts)
    fs = s3fs.S3FileSystem(**opts)
    sizes: list[int] = []
    for shard in index.shards:
        with fs.open(f"bench/v3/{shard.path}", "rb") as f:
            meta = pq.ParquetFile(f).metadata
        sizes += [group_span(meta, g)[1] - group_span(meta, g)[0] for g in range(meta.num_row_groups)]
    table = UnitTable(index)
    first, last = table.unit_of(start_row), table.unit_of(end_row - 1)
    return sum(sizes[k % table.total_units] for k in range(first, last + 1))


def run_hosts(moto: MotoS3, corpus: str, hosts: int, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration on a fresh ``hosts``-node cluster: the ranks' rows (hashed) and each
    host's counters."""
    import ray

    from elastic.ingest.corpus import BatchLayout
    from elastic.ingest.host_readers import FeederSource, HostReaders
    from elastic.testing.s3proxy import CountingProxy
    from jobs import JobSpec

    proxy = CountingProxy(moto.endpoint, prefix=f"/bench/{corpus}")
    loader = "ray_data" if args.engine == "ray_data" else "feeder"
    spec = JobSpec.from_dict(
        {
            "name": "bytes-per-host",
            "model": {"seq_len": args.seq_len, "vocab_size": 257},
            "data": {
                "source": f"s3://bench/{corpus}",
                "storage_options": moto.options(proxy.endpoint),
                "loader": loader,
            },
            "parallel": {"micro_batch": 1},
            "elastic": {"min_dp": hosts, "max_dp": hosts, "collective_timeout_s": 60},
            "train": {"global_batch": args.global_batch},
        }
    )
    layout = BatchLayout(args.global_batch, 1, hosts)
    hashes: list[str] = [""] * hosts
    try:
        with local_cluster(hosts, dashboard=False, log_level=logging.ERROR):
            nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)
            readers = HostReaders(spec, spec.data.source)
            plans = readers.plans(nodes, generation=1)
            t0 = time.perf_counter()

            def rank(r: int) -> None:
                source = FeederSource(plans[r], spec.data, spec.elastic.collective_timeout_s)
                h = hashlib.sha256()
                stream = source.open(layout, r, args.start_batch)  # what the rank's trainer calls
                for _ in range(args.batches):
                    _, rows = next(stream)
                    h.update(rows.tobytes())
                hashes[r] = h.hexdigest()

            threads = [threading.Thread(target=rank, args=(r,)) for r in range(hosts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=600)
            wall = time.perf_counter() - t0
            stats = settled(
                readers, proxy, len(moto.client.get_object(Bucket="bench", Key=f"{corpus}/index.json")["Body"].read())
            )
            readers.close()
    finally:
        proxy.close()
    if not all(hashes):
        raise RuntimeError(f"{corpus} at {hosts} hosts: a rank did not finish")
    keys = ("bytes_read", "index_bytes", "footer_bytes", "data_bytes", "gets", "footers", "units_read", "rows_read")
    per_host = [{k: stats[n][k] for k in keys} for n in sorted(stats)]
    gets, proxy_bytes = proxy.counts()
    repeats: dict[tuple[str, str], list[float]] = {}
    for t, path, ranged, _ in proxy.served:
        repeats.setdefault((path, ranged), []).append(t)
    close = [(k, v) for k, v in repeats.items() if len(v) > hosts + 1]  # more than once per host (and driver)
    return {
        "per_host": per_host,
        "hashes": hashes,
        "proxy_gets": gets,
        "proxy_bytes": proxy_bytes,
        "wall_s": wall,
        "repeated": [f"{p} {r} x{len(v)}" for (p, r), v in close][:20],
    }


def settled(readers: Any, proxy: Any, index_bytes: int, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
    """The feeders' counters once the reads they had in flight when the ranks stopped have
    landed: the server side saw as many bytes as they counted, and at most the driver's look
    at the index besides (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = readers.stats()
        if proxy.inflight == 0 and proxy.counts()[1] - sum(st["bytes_read"] for st in stats.values()) <= index_bytes:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def measure(moto: MotoS3, hosts: int, args: argparse.Namespace, looked_up: set[str]) -> dict[str, Any]:
    """The three indexes at ``hosts`` hosts. The ratios count what the server saw (less the
    driver's one look at the index, ``resolve_loader``, once per corpus in this process);
    the per-host figures are the feeders' own counters, which must add up to it."""
    g = args.global_batch
    consumed = consumed_bytes(moto, args.start_batch * g, (args.start_batch + args.batches) * g)
    out: dict[str, Any] = {"hosts": hosts, "consumed_bytes": consumed}
    for corpus in CORPORA:
        got = run_hosts(moto, corpus, hosts, args)
        total = sum(h["bytes_read"] for h in got["per_host"])
        index_size = len(moto.client.get_object(Bucket="bench", Key=f"{corpus}/index.json")["Body"].read())
        driver = 0 if corpus in looked_up else index_size
        looked_up.add(corpus)
        server = got["proxy_bytes"] - driver
        out[corpus] = {
            "bytes_read_total": server,  # at the server side, by the host readers
            "bytes_read_per_host": [h["bytes_read"] for h in got["per_host"]],  # their own counters
            "mean_bytes_read_per_host": server / hosts,
            "footer_bytes_total": sum(h["footer_bytes"] for h in got["per_host"]),  # metadata: footers or records
            "metadata_ratio_to_consumed": sum(h["footer_bytes"] for h in got["per_host"]) / consumed,
            "index_bytes_total": sum(h["index_bytes"] for h in got["per_host"]),
            "data_bytes_total": sum(h["data_bytes"] for h in got["per_host"]),
            "gets_total": sum(h["gets"] for h in got["per_host"]),
            "server_bytes": got["proxy_bytes"],
            "server_gets": got["proxy_gets"],
            "driver_index_bytes": driver,
            "unattributed_bytes": server - total,  # seen by the server, not counted by a feeder
            "ratio_read_to_consumed": server / consumed,
            "data_ratio_read_to_consumed": sum(h["data_bytes"] for h in got["per_host"]) / consumed,
            "wall_s": got["wall_s"],
            "per_host": got["per_host"],
            "_hashes": got["hashes"],
        }
        if server != total:
            print(
                f"WARNING {corpus}: the server saw {server - total:+,} B more than the feeders counted "
                f"({got['proxy_gets']} GETs, the feeders {sum(h['gets'] for h in got['per_host'])}); "
                f"read more often than once per host: {got['repeated']}",
                flush=True,
            )
            out[corpus]["repeated"] = got["repeated"]
        print(
            f"[{hosts} hosts] {corpus}: {server:,} B read, {consumed:,} B consumed: {server / consumed:.3f}x",
            flush=True,
        )
    hashes = {c: out[c].pop("_hashes") for c in CORPORA}
    if len({json.dumps(h) for h in hashes.values()}) != 1:
        raise RuntimeError(f"{hosts} hosts: the ranks' rows differ between the indexes")
    out["v2_over_v3"] = out["v2"]["bytes_read_total"] / out["v3"]["bytes_read_total"]
    out["v1_over_v3"] = out["v1"]["bytes_read_total"] / out["v3"]["bytes_read_total"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="4,8", help="host counts, comma-separated")
    ap.add_argument("--batches", type=int, default=96, help="batches every rank consumes")
    ap.add_argument("--start-batch", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1023)
    ap.add_argument("--rows-per-shard", type=int, default=256)
    ap.add_argument("--rows-per-group", type=int, default=8)
    ap.add_argument("--engine", choices=("ray_data", "threads"), default="ray_data")
    ap.add_argument("--out", default=results_path("data_bytes_per_host.json"))
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    args = ap.parse_args(argv)
    logging.getLogger("ray").setLevel(logging.ERROR)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    results: dict[str, Any] = {**measured_now(), "load_before": os.getloadavg(), "settings": vars(args)}
    tmp = tempfile.mkdtemp(prefix="bytes-per-host-")
    moto = MotoS3("bench")
    try:
        os.environ.update(MotoS3.environ(moto.endpoint))
        results["corpus"] = make_corpus(moto, tmp, args)
        looked_up: set[str] = set()
        results["runs"] = [measure(moto, int(h), args, looked_up) for h in args.hosts.split(",")]
    finally:
        moto.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    write_json(args.out, results, newline=False)
    for run in results["runs"]:
        v3, v2, v1 = (run[c] for c in CORPORA)
        print(
            f"{run['hosts']} hosts: bytes read / bytes consumed: row groups with their records (v3) "
            f"{v3['ratio_read_to_consumed']:.3f}x (metadata {v3['metadata_ratio_to_consumed']:.3f}x), "
            f"row groups after footers (v2) {v2['ratio_read_to_consumed']:.3f}x (metadata "
            f"{v2['metadata_ratio_to_consumed']:.3f}x), whole shards (v1) {v1['ratio_read_to_consumed']:.3f}x; "
            "per host "
            f"{v3['mean_bytes_read_per_host']:,.0f} B, {v2['mean_bytes_read_per_host']:,.0f} B, "
            f"{v1['mean_bytes_read_per_host']:,.0f} B"
        )
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
