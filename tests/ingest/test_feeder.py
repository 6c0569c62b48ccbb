"""The host feeder serves exactly the native reader's rows, at any DP, start batch and set of
served slices, reads only what its slices consume (metadata included: a version 3 corpus's
row-group records, in proportion to the groups read), and a job trained from it matches the
native reader step by step (version 2 and 1 indexes too: by footer, and whole-shard)."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

from elastic import ElasticTrainer
from elastic.ingest.corpus import BatchLayout, ParquetCorpus
from elastic.ingest.feeder import HostFeeder
from elastic.ingest.host_readers import feeder_batches, resolve_loader
from elastic.ingest.index import read_index
from elastic.ingest.prepare import PrepareConfig, prepare
from elastic.ingest.shard_format import group_span
from elastic.ingest.units import StreamRequest
from elastic.testing.corpora import as_version, write_corpus
from elastic.testing.texts import stdlib_texts, write_jsonl
from jobs import JobSpec

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

G = 24  # global batch: data shards of 24, 12, 8, 6 and 3 rows at dp 1, 2, 3, 4 and 8


@pytest.fixture
def local_corpus(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(str(root / "in"), stdlib_texts(("json",)))
    out = str(root / "out")
    cfg = PrepareConfig(str(root / "in"), out, tokenizer="byte", seq_len=16, rows_per_shard=48, progress=False)
    cfg.rows_per_group = 3
    prepare(cfg)
    return out


def _feeder(uri, rows_ahead=2 * G, max_reads=2, engine="threads"):
    return HostFeeder.remote(uri, {}, rows_ahead, rows_ahead + G, max_reads, 30.0, engine)


def _begin(feeder, epoch: str, start_batch: int, dp: int, served: tuple[int, ...]) -> bool:
    went_on = ray.get(feeder.begin.remote(StreamRequest(epoch, start_batch * G, G, dp, served)), timeout=60)
    ray.get(feeder.ready.remote(epoch, 60.0), timeout=90)
    return went_on


def _check(hosts, native, dp: int, start_batch: int, batches: int, epoch: str) -> None:
    """Every data shard's rows from its host's feeder, batch by batch, equal the native reader's."""
    layout = BatchLayout(global_batch=G, micro_batch=1, dp=dp)
    streams = {r: feeder_batches(f, layout, r, start_batch, 30.0, epoch) for f, served in hosts for r in served}
    for b in range(start_batch, start_batch + batches):
        for r in range(dp):
            got_b, rows = next(streams[r])
            assert got_b == b
            np.testing.assert_array_equal(rows, native.rows(layout.rank_samples(b, r)))


@pytest.mark.parametrize("engine, version", [("ray_data", 3), ("threads", 3), ("threads", 2)])
def test_feeder_rows_equal_the_native_reader_at_any_dp_and_start(local_corpus, tmp_path, engine, version):
    """Three feeders (hosts) share each layout's data shards, adjacent or not (version 3: by
    row-group records; version 2: by footer)."""
    uri = local_corpus if version == 3 else as_version(local_corpus, str(tmp_path / "old"), version)
    native = ParquetCorpus(uri)
    end = native.num_rows // G  # the wrap case starts 2 batches before the epoch's end
    feeders = [_feeder(uri, max_reads=1, engine=engine) for _ in range(3)]
    for i, (dp, start, assignment) in enumerate(
        [
            (1, 0, [(0,)]),
            (2, 3, [(0,), (1,)]),
            (3, 7, [(0, 2), (1,)]),
            (4, end - 2, [(0,), (1, 3), (2,)]),
            (8, 5, [(0, 3, 5), (1, 2), (4, 6, 7)]),
        ]
    ):
        hosts = list(zip(feeders, assignment))
        for f, served in hosts:
            _begin(f, f"e{i}", start, dp, served)
        _check(hosts, native, dp, start, 6, f"e{i}")
    stats = ray.get([f.get_stats.remote() for f in feeders])
    for st in stats:
        assert st["bytes_read"] == st["index_bytes"] + st["footer_bytes"] + st["data_bytes"] > 0
        assert st["cached_units"] <= (2 * G + G + G) // 3 + 4  # a bounded window: ahead + behind
        if version == 3:  # no footer: one read of records per read of row groups, two GETs each
            assert st["gets"] == 1 + 2 * st["footers"] and st["cached_footers"] == 0
    for f in feeders:
        ray.kill(f)


@pytest.mark.parametrize("engine", ["ray_data", "threads"])
def test_a_feeder_goes_on_across_layouts_and_jumps_only_when_it_must(local_corpus, engine):
    """Two hosts. A new layout at the next batch (a resize 4 -> 3 -> 4, a recovery from memory)
    or a batch back (a rollback) continues the stream each feeder holds: no new read of the
    index, for engine ray_data the same executor, and only the units the new slices need and
    it lacks are read. A start it does not hold (a restore from storage of an old step) jumps
    there. Rows equal the native reader's throughout."""
    native = ParquetCorpus(local_corpus)
    a, b = _feeder(local_corpus, engine=engine), _feeder(local_corpus, engine=engine)
    for epoch, dp, start, served_a, served_b, goes_on in (
        ("e0", 4, 0, (0, 1), (2, 3), False),  # the first stream of each
        ("e1", 3, 6, (0, 1), (2,), True),  # host b lost a replica
        ("e2", 4, 12, (0, 1), (2, 3), True),  # and got it back: b reads rows 12..15 of each batch too
        ("e3", 4, 17, (0, 1), (2, 3), True),  # a rollback of one step
        ("e4", 4, 2, (0, 1), (2, 3), False),  # a restore from storage of an old step
        ("e5", 3, 60, (0, 1), (2,), False),
    ):
        assert _begin(a, epoch, start, dp, served_a) is goes_on, epoch
        assert _begin(b, epoch, start, dp, served_b) is goes_on, epoch
        assert ray.get(a.begin.remote(StreamRequest(epoch, start * G, G, dp, served_a)), timeout=30) is goes_on
        _check([(a, served_a), (b, served_b)], native, dp, start, 6, epoch)
    with pytest.raises(ray.exceptions.RayTaskError, match="replaced"):  # an old layout's rank is refused
        ray.get(a.rows.remote(0, 4, 0, "e1"), timeout=30)
    with pytest.raises(ray.exceptions.RayTaskError, match="not in the slices"):  # b does not serve slice 0
        ray.get(b.rows.remote(66 * G, 8, 0, "e5"), timeout=30)
    for st in ray.get([a.get_stats.remote(), b.get_stats.remote()]):
        assert st["streams"] == 6 and st["continued"] == 3 and st["gets"] > 0
        assert st["index_bytes"] == os.path.getsize(f"{local_corpus}/index.json")  # read once
        if engine == "ray_data":
            assert st["executors"] == 3  # the first stream's, and one per jump
    ray.kill(a)
    ray.kill(b)


def _group_bytes(uri: str) -> tuple[np.ndarray, np.ndarray]:
    """First global row and bytes of every row group of the corpus, from the shards' footers."""
    starts, sizes, base = [], [], 0
    for shard in read_index(uri).shards:
        meta = pq.read_metadata(f"{uri}/{shard.path}")
        for g in range(meta.num_row_groups):
            lo, hi = group_span(meta, g)
            starts.append(base)
            sizes.append(hi - lo)
            base += meta.row_group(g).num_rows
    return np.asarray(starts), np.asarray(sizes)


def test_feeders_read_about_what_their_replicas_consume(ray_local, tmp_path):
    """dp 4, one feeder per DP rank (as on 4 hosts), 24 batches, on rows of 1,025 ids in
    groups of 3 rows (about 3.5 kB each) and shards of 48. The bytes consumed are those of
    the row groups holding the consumed rows, each counted once.

    The four feeders' data reads add up to at most (24 + 2) / 24 of that: the window reads 2
    batches past the last one consumed, and the groups divide each rank's share (6 rows), so
    no group is read by two feeders. Version 3: each feeder reads one record (``W`` bytes:
    the group's mini-footer and its entry) per group it reads and no other metadata, so data
    and metadata together are at most ``(24 + 2) / 24 * (1 + W / g)`` of what is consumed
    (``g`` the smallest group), a term of the corpus that no number of hosts changes; the
    index (once per feeder) aside. A version 2 index would have each feeder read the footer
    of every shard its stream reaches, which grows with the hosts (at dp 4 already more than
    version 3's records; ``test_units`` measures it at dp 2, 4 and 8). Version 1 (the same
    shards): whole shards cost each feeder the whole stream."""
    rows = np.random.default_rng(5).integers(0, 300, size=(14 * 48, 1025), dtype=np.int32)
    v3 = str(tmp_path / "v3")
    index = write_corpus(v3, rows, 48, 3)
    width = int(index.shards[0].groups_record_bytes or 0)
    starts, sizes = _group_bytes(v3)
    start, batches, dp = 2, 24, 4
    first, last = np.searchsorted(starts, start * G, "right") - 1, np.searchsorted(starts, (start + batches) * G)
    consumed = int(sizes[first:last].sum())  # the whole run in one epoch: (2 + 24 + 2) * 24 = 14 * 48 rows
    ratio, meta = {}, {}
    for version in (3, 1):
        uri = v3 if version == 3 else as_version(v3, str(tmp_path / f"v{version}"), version)
        feeders = [_feeder(uri) for _ in range(dp)]
        for r, f in enumerate(feeders):
            _begin(f, "e0", start, dp, (r,))
        _check([(f, (r,)) for r, f in enumerate(feeders)], ParquetCorpus(uri), dp, start, batches, "e0")
        stats = ray.get([f.get_stats.remote() for f in feeders])
        for f in feeders:
            ray.kill(f)
        ratio[version] = sum(st["data_bytes"] for st in stats) / consumed
        meta[version] = sum(st["footer_bytes"] for st in stats)
        assert all(st["index_bytes"] == os.path.getsize(f"{uri}/index.json") for st in stats)
        if version == 3:
            assert all(st["footer_bytes"] == width * st["units_read"] for st in stats)
            both = ratio[3] + meta[3] / consumed
            assert 1.0 <= both <= (batches + 2) / batches * (1 + width / sizes.min()), both
    footers = dp * sum(s.footer_bytes or 0 for s in index.shards[1 : 1 + batches * G // 48])  # version 2, at least
    print(
        f"bytes read / bytes consumed at dp 4: data {ratio[3]:.3f} (v3), {ratio[1]:.3f} (v1); "
        f"metadata {meta[3] / consumed:.3f} (v3 records; v2 footers would be {footers / consumed:.3f} or more)"
    )
    assert 1.0 <= ratio[3] <= (batches + 2) / batches
    assert meta[3] < footers
    assert ratio[1] > 3.5


def _spec(source: str, loader: str) -> JobSpec:
    return JobSpec.from_dict(
        {
            "name": "feed",
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 257, "seq_len": 16},
            "data": {"source": source, "loader": loader},
            "parallel": {"micro_batch": 2},
            "elastic": {"min_dp": 2, "max_dp": 2, "collective_timeout_s": 20},
            "train": {"steps": 6, "global_batch": 8, "lr": 3.0e-3},
            "checkpoint": {"every_steps": 0},
        }
    )


def _steps(run_dir: str) -> list[dict]:
    return [e for e in map(json.loads, open(f"{run_dir}/events.jsonl")) if e["kind"] == "step"]


def test_training_through_ray_data_matches_the_native_reader(local_corpus, tmp_path):
    """The default loader on a version 3 corpus (what ``elastic prepare`` writes), and on the
    same shards under a version 2 index (by footer) and the feeder under a version 1 index
    (whole shards), as older ``elastic prepare`` wrote them, train step by step as the native
    reader does."""
    assert resolve_loader(_spec(local_corpus, "auto").data, local_corpus) == "ray_data"  # the default path
    v2 = as_version(local_corpus, str(tmp_path / "v2"), 2)
    v1 = as_version(local_corpus, str(tmp_path / "v1"), 1)
    runs = (("v3", local_corpus, "ray_data"), ("v2", v2, "ray_data"), ("v1", v1, "feeder"), ("native", v1, "native"))
    got = {}
    for name, source, loader in runs:
        run_dir = str(tmp_path / name)
        ElasticTrainer(_spec(source, loader), run_dir=run_dir).fit()
        got[name] = _steps(run_dir)
    assert [len(steps) for steps in got.values()] == [6, 6, 6, 6]
    for *readers, native in zip(got["v3"], got["v2"], got["v1"], got["native"]):
        for x in readers:
            assert x["loss"] == pytest.approx(native["loss"], rel=1e-6)
            assert x["grad_norm"] == pytest.approx(native["grad_norm"], rel=1e-6)
            assert x["data_wait_s"] >= 0
