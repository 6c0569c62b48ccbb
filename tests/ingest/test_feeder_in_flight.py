"""A host feeder's GETs in flight, counted at storage (a real S3 server, moto on loopback,
behind the counting proxy, each GET held ``LATENCY_S``), never exceed its cap
(``data.max_reads_per_host``): not when a second stream begins while the first one's turn
reads the index, not when a stream jumps while reads of the old position are in flight
(engine ``ray_data``: its old executor's permitted reads are drained before a new one reads),
and a quiesced feeder (``HostFeeder.quiesce``, what the driver does before every new layout)
returns with none in flight and starts none until its next stream; a pause that names an
older layout (``HostReaders.pause``) leaves a later stream reading."""

from __future__ import annotations

import os
import time

import pytest
import ray
from waiting import wait_until

from elastic.ingest.feeder import HostFeeder
from elastic.ingest.prepare import PrepareConfig, prepare
from elastic.ingest.units import StreamRequest
from elastic.testing.s3proxy import CountingProxy
from elastic.testing.texts import stdlib_texts, write_jsonl

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

G = 24
LATENCY_S = 0.5  # long enough that a jump's new reads would meet the old ones


@pytest.fixture
def s3_corpus(ray_local, moto_s3, s3_bucket, tmp_path):
    write_jsonl(str(tmp_path / "in"), stdlib_texts(("json",)))
    out = str(tmp_path / "out")
    cfg = PrepareConfig(str(tmp_path / "in"), out, tokenizer="byte", seq_len=16, rows_per_shard=48, progress=False)
    cfg.rows_per_group = 3
    prepare(cfg)
    client = moto_s3.client()
    for name in sorted(os.listdir(out)):
        client.upload_file(os.path.join(out, name), s3_bucket, f"corpus/{name}")
    proxy = CountingProxy(moto_s3.endpoint, prefix=f"/{s3_bucket}/corpus", get_latency_s=LATENCY_S)
    yield f"s3://{s3_bucket}/corpus", dict(moto_s3.options(), endpoint_url=proxy.endpoint), proxy
    proxy.close()


def _begin(feeder, epoch: str, start_batch: int) -> None:
    ray.get(feeder.begin.remote(StreamRequest(epoch, start_batch * G, G, 1, (0,))), timeout=60)


@pytest.mark.parametrize("engine, reads", [("ray_data", 2), ("threads", 1)])
def test_gets_in_flight_stay_within_the_cap_across_jumps_and_stop_when_quiesced(s3_corpus, engine, reads):
    uri, options, proxy = s3_corpus
    feeder = HostFeeder.remote(uri, options, 2 * G, 3 * G, reads, 60.0, engine)
    try:
        _begin(feeder, "e0", 0)
        _begin(feeder, "e1", 10)  # while e0's turn reads the index: read once, by one of them
        ray.get(feeder.ready.remote("e1", 120.0), timeout=150)
        _begin(feeder, "e2", 0)  # a jump back
        wait_until(lambda: proxy.inflight >= reads, 60, f"{reads} GET(s) of e2 in flight", 0.01)
        _begin(feeder, "e3", 40)  # a jump while they are in flight
        ray.get(feeder.ready.remote("e3", 120.0), timeout=150)
        assert proxy.peak() <= reads, proxy.at_peak()

        _begin(feeder, "e4", 20)
        wait_until(lambda: proxy.inflight >= 1, 60, "a GET of e4 in flight", 0.01)
        assert ray.get(feeder.quiesce.remote(30.0), timeout=60) == 0
        assert proxy.inflight == 0
        gets = proxy.counts()[0]
        time.sleep(2 * LATENCY_S)  # a while in which nothing may happen
        assert proxy.counts()[0] == gets and proxy.inflight == 0  # and none started since
        _begin(feeder, "L5-0", 20)  # the next stream reads again
        # A pause of an older layout's streams (``HostReaders.pause`` at a failure, arriving
        # late) leaves this one reading: its first window comes.
        assert ray.get(feeder.quiesce.remote(0.0, "L4"), timeout=60) >= 0
        ray.get(feeder.ready.remote("L5-0", 120.0), timeout=150)
        stats = ray.get(feeder.get_stats.remote(), timeout=30)
        assert stats["gets"] == 1 + 2 * stats["footers"]  # the index once; two GETs per read of row groups
        assert proxy.peak() <= reads, proxy.at_peak()
    finally:
        ray.kill(feeder)
