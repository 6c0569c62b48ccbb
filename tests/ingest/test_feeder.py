"""The host feeder serves exactly the native reader's rows, at any DP and start batch, and a
job trained from it matches the native reader step by step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import ray

from elastic import ElasticTrainer
from elastic.ingest.corpus import BatchLayout, ParquetCorpus
from elastic.ingest.feeder import HostFeeder
from elastic.ingest.host_readers import feeder_batches, resolve_loader
from elastic.ingest.prepare import PrepareConfig, prepare
from elastic.testing.texts import stdlib_texts, write_jsonl
from jobs import JobSpec

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture
def local_corpus(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(str(root / "in"), stdlib_texts(("json",)))
    out = str(root / "out")
    prepare(PrepareConfig(str(root / "in"), out, tokenizer="byte", seq_len=16, rows_per_shard=50, progress=False))
    return out


def _feeder(uri, start_row, rows_ahead=64, max_reads=2, engine="threads"):
    feeder = HostFeeder.remote(uri, {}, rows_ahead, rows_ahead, max_reads, 30.0, engine)
    ray.get(feeder.begin.remote("e0", start_row, 0, 1, 1, None), timeout=30)
    return feeder


def _check(feeder, native, layout, start_batch, batches, epoch=None):
    streams = [feeder_batches(feeder, layout, r, start_batch, 30.0, epoch) for r in range(layout.dp)]
    for b in range(start_batch, start_batch + batches):
        for r, s in enumerate(streams):
            got_b, rows = next(s)
            assert got_b == b
            np.testing.assert_array_equal(rows, native.rows(layout.rank_samples(b, r)))


@pytest.mark.parametrize("engine", ["ray_data", "threads"])
def test_feeder_rows_equal_the_native_reader_at_any_dp_and_start(local_corpus, engine):
    native = ParquetCorpus(local_corpus)
    total = native.num_rows
    for dp, start_batch in [(1, 0), (2, 3), (3, 7), (2, total // 12)]:  # the last one wraps past the epoch end
        layout = BatchLayout(global_batch=12, micro_batch=2, dp=dp)
        feeder = _feeder(local_corpus, start_batch * 12, engine=engine)
        _check(feeder, native, layout, start_batch, 30)
        stats = ray.get(feeder.get_stats.remote())
        # a bounded window, not the whole corpus: 3 shards ahead of the slowest rank, 64 rows (<= 3 shards) kept behind
        assert stats["gets"] >= 1 and stats["cached_units"] <= 8
        ray.kill(feeder)


@pytest.mark.parametrize("engine", ["ray_data", "threads"])
def test_a_feeder_goes_on_across_layouts_and_jumps_only_when_it_must(local_corpus, engine):
    """A new layout at the next batch (a resize, a recovery from memory) or a batch back (a
    rollback) continues the stream the feeder holds: no new read of the index, and for
    engine ray_data the same executor. A start it does not hold (a restore from storage of
    an old step) jumps there. Rows equal the native reader's throughout."""
    native = ParquetCorpus(local_corpus)
    feeder = _feeder(local_corpus, 0, rows_ahead=36, engine=engine)
    _check(feeder, native, BatchLayout(global_batch=12, micro_batch=2, dp=2), 0, 10)
    for epoch, dp, start, goes_on in (
        ("e1", 3, 10, True),
        ("e2", 1, 16, True),
        ("e3", 2, 2, False),
        ("e4", 3, 60, False),
    ):
        assert ray.get(feeder.begin.remote(epoch, start * 12, 0, 1, 1, None), timeout=30) is goes_on, epoch
        assert ray.get(feeder.begin.remote(epoch, start * 12, 0, 1, 1, None), timeout=30) is goes_on  # idempotent
        ray.get(feeder.ready.remote(epoch, 30.0), timeout=60)
        _check(feeder, native, BatchLayout(global_batch=12, micro_batch=2, dp=dp), start, 8, epoch)
    with pytest.raises(ray.exceptions.RayTaskError, match="replaced"):  # an old layout's rank is refused
        ray.get(feeder.rows.remote(0, 4, 0, "e1"), timeout=30)
    stats = ray.get(feeder.get_stats.remote())
    assert stats["streams"] == 5 and stats["continued"] == 2
    if engine == "ray_data":
        assert stats["executors"] == 3  # the first stream's, and one per jump
    ray.kill(feeder)


def _spec(source: str, loader: str) -> JobSpec:
    return JobSpec.from_dict(
        {
            "name": "feed",
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 257, "seq_len": 16},
            "data": {"source": source, "loader": loader},
            "parallel": {"micro_batch": 2},
            "elastic": {"min_dp": 2, "max_dp": 2, "collective_timeout_s": 20},
            "train": {"steps": 10, "global_batch": 8, "lr": 3.0e-3},
            "checkpoint": {"every_steps": 0},
        }
    )


def _steps(run_dir: str) -> list[dict]:
    return [e for e in map(json.loads, open(f"{run_dir}/events.jsonl")) if e["kind"] == "step"]


def test_training_through_ray_data_matches_the_native_reader(local_corpus, tmp_path):
    assert resolve_loader(_spec(local_corpus, "auto").data, local_corpus) == "ray_data"  # the default path
    got = {}
    for loader in ("ray_data", "native"):
        run_dir = str(tmp_path / loader)
        ElasticTrainer(_spec(local_corpus, loader), run_dir=run_dir).fit()
        got[loader] = _steps(run_dir)
    assert len(got["ray_data"]) == len(got["native"]) == 10
    for a, b in zip(got["ray_data"], got["native"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-6
        )
        assert a["data_wait_s"] >= 0 and "data_wait_s" in b
