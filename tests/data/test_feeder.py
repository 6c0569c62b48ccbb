"""The host feeder serves exactly the native reader's rows, at any DP and start batch, and a
job trained from it matches the native reader step by step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import ray
from ingest_testlib import stdlib_texts, write_jsonl

from elastic import ElasticTrainer
from elastic.data import BatchLayout, ParquetCorpus
from elastic.ingest.feeder import HostFeeder, feeder_batches, resolve_loader
from elastic.ingest.prepare import PrepareConfig, prepare
from jobs import JobSpec

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def local_corpus(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(str(root / "in"), stdlib_texts(("json",)))
    out = str(root / "out")
    prepare(PrepareConfig(str(root / "in"), out, tokenizer="byte", seq_len=16, rows_per_shard=50, progress=False))
    return out


def _feeder(uri, start_row, rows_ahead=64, max_reads=2, engine="threads"):
    return HostFeeder.remote(uri, {}, start_row, rows_ahead, max_reads, None, 0, 1, 1, 30.0, engine)


@pytest.mark.parametrize("engine", ["ray_data", "threads"])
def test_feeder_rows_equal_the_native_reader_at_any_dp_and_start(local_corpus, engine):
    native = ParquetCorpus(local_corpus)
    total = native.num_rows
    for dp, start_batch in [(1, 0), (2, 3), (3, 7), (2, total // 12)]:  # the last one wraps past the epoch end
        layout = BatchLayout(global_batch=12, micro_batch=2, dp=dp)
        feeder = _feeder(local_corpus, start_batch * 12, engine=engine)
        streams = [feeder_batches(feeder, layout, r, start_batch, 30.0) for r in range(dp)]
        for b in range(start_batch, start_batch + 30):
            for r, s in enumerate(streams):
                got_b, rows = next(s)
                assert got_b == b
                np.testing.assert_array_equal(rows, native.rows(layout.rank_samples(b, r)))
        stats = ray.get(feeder.get_stats.remote())
        assert stats["gets"] >= 1 and stats["cached_units"] <= 6  # a bounded window, not the whole corpus
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
    assert resolve_loader(_spec(local_corpus, "auto").data, local_corpus) == "feeder"  # the default path
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
