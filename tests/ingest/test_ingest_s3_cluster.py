"""Text in JSON lines on a real S3 server (moto on loopback) -> ``elastic prepare`` ->
training from ``s3://`` on a 4-node cluster, with a node lost mid-run.

A counting proxy between the job and the server measures the GETs in flight at the
server side: with ``data.waves: 4`` and ``data.max_reads_per_host: 2`` there are at most
``ceil(4 / 4) * 2 = 2`` from the driver's check of the corpus (its index, footers and first
rows, before anything starts) to the job's start, and from the driver's quiesce of the
survivors' readers to the new layout's first windows (docs/data.md, "Staggered reads";
the windows: ``elastic.testing.read_windows``). Each GET is held ``LATENCY_S`` at the proxy,
like an object store's time to first byte: on loopback a GET takes about a millisecond,
and reads that break the bound would seldom overlap.

The fault-free reference is the same spec trained by one rank in the test's process, without
Ray (``single_rank_metrics``), reading the same ``s3://`` corpus with the native reader
straight from the server (not through the proxy): the same samples per step by another reader,
at dp 1 instead of the cluster's 4 and 3.
"""

from __future__ import annotations

import math
import os
import time

import pytest
from elastic_testlib import REL_SAME_ORDER, single_rank_metrics
from waiting import wait_until

import elastic.api
from elastic import ElasticTrainer
from elastic.events import read_events
from elastic.faults import Fault, FaultInjector, WorkerFaults, worker_fault
from elastic.testing.read_windows import QuiesceClock, recovery_window, startup_window
from elastic.testing.s3proxy import CountingProxy
from elastic.testing.texts import stdlib_texts, write_jsonl
from jobs import JobSpec
from jobs.cli import main as cli_main

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(400)]

STEPS, FAULT_STEP = 16, 6
READS = 2  # data.max_reads_per_host
LATENCY_S = 0.05  # each data GET's time to first byte at the proxy


def _spec(source: str, options: dict, waves: int) -> JobSpec:
    return JobSpec.from_dict(
        {
            "name": "s3-ingest",
            "seed": 1,
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 257, "seq_len": 16},
            "data": {"source": source, "storage_options": options, "waves": waves, "max_reads_per_host": READS},
            "parallel": {"micro_batch": 1},
            "elastic": {"min_dp": 1, "max_dp": 4, "heartbeat_timeout_s": 4, "collective_timeout_s": 10},
            "train": {"steps": STEPS, "global_batch": 12, "lr": 3.0e-3},
            "checkpoint": {"every_steps": 0, "memory_every_steps": 1},
        }
    )


def _upload_text(moto_s3, bucket: str, local: str) -> None:
    client = moto_s3.client()
    for name in sorted(os.listdir(local)):
        client.upload_file(os.path.join(local, name), bucket, f"text/{name}")


def test_s3_text_prepared_then_trained_with_a_node_loss(ray_cluster, moto_s3, s3_bucket, tmp_path, monkeypatch):
    write_jsonl(str(tmp_path / "text"), stdlib_texts(("json", "email")))
    _upload_text(moto_s3, s3_bucket, str(tmp_path / "text"))
    opts = moto_s3.options()
    for var, value in (
        ("AWS_ENDPOINT_URL", moto_s3.endpoint),
        ("AWS_ACCESS_KEY_ID", opts["key"]),
        ("AWS_SECRET_ACCESS_KEY", opts["secret"]),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        monkeypatch.setenv(var, value)
    corpus = f"s3://{s3_bucket}/corpus"
    rc = cli_main(["prepare", f"s3://{s3_bucket}/text", corpus, "--seq-len", "16", "--rows-per-shard", "200"])
    assert rc == 0
    proxy = CountingProxy(moto_s3.endpoint, prefix=f"/{s3_bucket}/corpus", get_latency_s=LATENCY_S)
    checked: list[tuple[float, float]] = []  # the driver's corpus checks: (start, end)

    def timed_check(*args, **kwargs):
        t = time.time()
        columns = check_corpus(*args, **kwargs)
        checked.append((t, time.time()))
        return columns

    check_corpus = elastic.api.check_corpus
    monkeypatch.setattr(elastic.api, "check_corpus", timed_check)
    spec = _spec(corpus, dict(opts, endpoint_url=proxy.endpoint), waves=4)
    try:
        ref = single_rank_metrics(_spec(corpus, opts, waves=4), str(tmp_path / "ref-data"))
        injector = FaultInjector([Fault("kill_node", at_step=FAULT_STEP, node_index=2)], cluster=ray_cluster)
        slow = [worker_fault("slow", step=1, rank=r, seconds=0.1) for r in range(4)]
        run_dir = str(tmp_path / "run")
        t_fit = time.time()
        with QuiesceClock() as quiesces:
            result = ElasticTrainer(spec, run_dir=run_dir, callbacks=[injector], step_hook=WorkerFaults(slow)).fit()
        # Reads of a job that has ended must stop (none in flight, none begun for a second).
        wait_until(lambda: proxy.idle_s() > 1.0, 30, "the run's reads to stop", 0.1)
    finally:
        proxy.close()
    events = read_events(run_dir)
    steps = [e for e in events if e["kind"] == "step"]
    assert result.status == "succeeded" and [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert [e["cause"] for e in events if e["kind"] == "failure"] == ["node_lost"]
    assert all("data_wait_s" in e and e["data_wait_s"] >= 0 for e in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3  # it learns
    # Exactly the next samples after the node loss: every step matches the fault-free run
    # (dp 4 and 3 sum the same micro-batch gradients as dp 1 in another order: 1e-5).
    assert sorted(ref) == list(range(1, STEPS + 1))
    worst = max(abs(g - w) / abs(w) for e in steps for g, w in zip((e["loss"], e["grad_norm"]), ref[e["step"]]))
    print(f"max relative difference to the single-rank reference: {worst:.2e}")
    for e in steps:
        want_loss, want_norm = ref[e["step"]]
        assert e["loss"] == pytest.approx(want_loss, rel=REL_SAME_ORDER), e["step"]
        assert e["grad_norm"] == pytest.approx(want_norm, rel=REL_SAME_ORDER), e["step"]
    bound = math.ceil(4 / 4) * READS
    assert len(checked) == 1  # the driver checked the corpus once, before the run
    startup, recovery = startup_window(events, t_fit), recovery_window(events, quiesces.spans)
    startup_peak, recovery_peak = proxy.peak(*startup), proxy.peak(*recovery)
    # From the detection to the quiesce: the survivors' readers were paused at the detection
    # and only finish the GETs they had started, each host within its cap.
    failure = next(e["ts"] for e in events if e["kind"] == "failure")
    gap_peak = proxy.peak(failure, recovery[0])
    print(f"GETs in flight: start-up {startup_peak}; detection to quiesce {gap_peak}; after it {recovery_peak}")
    assert startup_peak <= bound, proxy.at_peak(*startup)
    assert recovery_peak <= bound, proxy.at_peak(*recovery)
    assert gap_peak <= 3 * READS, proxy.at_peak(failure, recovery[0])
    assert proxy.peak(*checked[0]) == 1  # the check reads one object at a time, and it reads
    assert proxy.gets > 0
    # The driver checked the corpus on S3 itself (its index and footers), not left it to the
    # readers: our option names (region, endpoint_url) reach s3fs translated.
    first_check = [p for t, p in proxy.paths if checked[0][0] <= t <= checked[0][1]]
    assert [p for p in first_check if p.endswith("/index.json")] == [f"/{s3_bucket}/corpus/index.json"], first_check
    assert any(p.endswith(".parquet") for p in first_check), first_check
    # The host readers outlive the recovery: the survivors' readers go on with the stream they
    # hold, so the run reads the index once per host (4), not again for the new layout. The
    # driver looks it up once more, to pick the loader (once per driver process and corpus:
    # ``elastic.ingest.host_readers.resolve_loader``; the bucket is new to this test), and once
    # to check that the corpus holds one global batch (``preflight.check_batch_fits``).
    index_reads = [p for t, p in proxy.paths if t > checked[0][1] and p.endswith("/index.json")]
    assert len(index_reads) == 2 + 4, index_reads
