"""What a host reader reads, without Ray: the units of the stream, which of them a host's
slices need (against brute force), the shard format's ranged reads and their checks, the
index versions, and the feeder's window in-process on real files (its reads, bytes and
rows against the native reader)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from elastic.ingest.corpus import BatchLayout, ParquetCorpus
from elastic.ingest.feeder import _HostFeeder
from elastic.ingest.index import CorpusIndex, Shard, parse_index, read_index, write_index
from elastic.ingest.prepare import shard_entry
from elastic.ingest.shard_format import decode_groups, groups_span, parse_footer
from elastic.ingest.units import StreamRequest, UnitTable, served_slices

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("g, n", [(12, 1), (12, 2), (12, 3), (24, 4), (24, 8), (10, 5)])
def test_a_request_needs_exactly_the_ranges_that_hold_its_slices(g, n):
    rng = np.random.default_rng(g * n)
    per = g // n
    for _ in range(20):
        served = tuple(sorted(set(rng.integers(0, n, size=rng.integers(1, n + 1)).tolist())))
        req = StreamRequest("e", 0, g, n, served)
        mine = {b * g + s * per + i for b in range(8) for s in served for i in range(per)}
        for start in range(0, 5 * g):
            for rows in (1, 2, 3, per, g - 1, g, 2 * g):
                want = any(r in mine for r in range(start, start + rows))
                assert req.needs(start, rows) == want, (served, start, rows)


def test_served_slices_follow_the_data_shard_rule():
    assert served_slices((0, 2), 4, 4) == (0, 2)
    assert served_slices((1,), 2, 4) == (2, 3)  # ep 2: replica 1 holds data shards 2 and 3
    with pytest.raises(ValueError, match="not a multiple"):
        served_slices((0,), 3, 4)
    with pytest.raises(ValueError, match="served slices"):
        StreamRequest("e", 0, 12, 3, (3,))
    with pytest.raises(ValueError, match="not split evenly"):
        StreamRequest("e", 0, 10, 3, (0,))


def _index(rows_per_shard: list[int], per_group: list[int | None]) -> CorpusIndex:
    shards = []
    for i, (rows, pg) in enumerate(zip(rows_per_shard, per_group)):
        v2 = {} if pg is None else dict(footer_offset=0, footer_bytes=1, footer_sha256="x", rows_per_group=pg)
        shards.append(Shard(f"p{i}", rows, 1, "y", **v2))
    return CorpusIndex("mem://", 4, {}, tuple(shards))


def test_the_unit_table_maps_every_row_both_ways():
    # shards of 10, 7 (v1: one unit), 9 rows; groups of 4 and 3 (ragged last groups)
    table = UnitTable(_index([10, 7, 9], [4, None, 3]))
    assert table.total_units == 3 + 1 + 3 and table.total_rows == 26
    units = [(0, 4), (4, 4), (8, 2), (10, 7), (17, 3), (20, 3), (23, 3)]
    for k in range(3 * table.total_units):  # three epochs
        epoch, u = divmod(k, table.total_units)
        start, rows = units[u]
        assert table.span(k) == (epoch * 26 + start, rows)
        assert all(table.unit_of(epoch * 26 + start + i) == k for i in range(rows))
    assert table.locate(4) == (0, 2, 0) and table.stream_shard(4 + 7) == 3 + 2
    assert table.last_unit_of_shard(1) == 2 and table.last_unit_of_shard(3) == 3


def _write(root, rows: np.ndarray, rows_per_shard: int, rows_per_group: int) -> CorpusIndex:
    shards = []
    for i, start in enumerate(range(0, len(rows), rows_per_shard)):
        data, shard = shard_entry(f"part-{i:05d}.parquet", rows[start : start + rows_per_shard], rows_per_group)
        (root / shard.path).write_bytes(data)
        shards.append(shard)
    index = CorpusIndex(str(root), rows.shape[1] - 1, {"vocab_size": 300}, tuple(shards))
    write_index(str(root), index)
    return index


def test_row_groups_read_alone_are_verified(tmp_path):
    rows = np.random.default_rng(0).integers(0, 300, size=(50, 9), dtype=np.int32)
    index = _write(tmp_path, rows, 50, 4)
    shard = index.shards[0]
    data = (tmp_path / shard.path).read_bytes()
    footer = data[shard.footer_offset :]
    assert len(footer) == shard.footer_bytes and index.version == 2
    meta = parse_footer(footer, shard.footer_sha256, shard.path)
    assert meta.num_row_groups == 13 and pq.ParquetFile(tmp_path / shard.path).metadata.num_rows == 50
    for first, count in ((0, 1), (3, 4), (12, 1), (0, 13)):
        lo, hi = groups_span(meta, first, count)
        got = decode_groups(meta, len(data), lo, data[lo:hi], first, count, shard.path)
        np.testing.assert_array_equal(got, rows[first * 4 : min(50, (first + count) * 4)])
    lo, hi = groups_span(meta, 5, 1)
    damaged = bytearray(data[lo:hi])
    damaged[-3] ^= 0xFF  # inside the page's data: its CRC no longer matches
    with pytest.raises(OSError, match="row groups 5..5"):
        decode_groups(meta, len(data), lo, bytes(damaged), 5, 1, shard.path)
    with pytest.raises(OSError, match="outside the fetched range"):
        decode_groups(meta, len(data), lo, data[lo:hi], 5, 2, shard.path)  # group 6 was not fetched
    bad = bytearray(footer)
    bad[len(bad) // 2] ^= 0x01
    with pytest.raises(OSError, match="footer checksum mismatch"):
        parse_footer(bytes(bad), shard.footer_sha256, shard.path)


def test_a_version_1_index_reads_as_whole_shards(tmp_path):
    rows = np.arange(40 * 5, dtype=np.int32).reshape(40, 5)
    index = _write(tmp_path, rows, 16, 4)
    raw = json.loads((tmp_path / "index.json").read_text())
    assert raw["version"] == 2 and raw["shards"][0]["rows_per_group"] == 4
    for s in raw["shards"]:  # what an older `elastic prepare` wrote
        for key in ("footer_offset", "footer_bytes", "footer_sha256", "rows_per_group"):
            del s[key]
    raw["version"] = 1
    old = parse_index(str(tmp_path), json.dumps(raw).encode())
    assert old.version == 1 and not any(s.ranged for s in old.shards)
    assert UnitTable(old).total_units == 3 and UnitTable(index).total_units == 4 + 4 + 2
    assert json.loads(json.dumps(old.to_json()))["version"] == 1 and "rows_per_group" not in old.to_json()["shards"][0]
    assert read_index(str(tmp_path)) == index
    raw["version"] = 3
    with pytest.raises(ValueError, match="newer than this reader"):
        parse_index(str(tmp_path), json.dumps(raw).encode())


def _consume(feeders, layout: BatchLayout, hosts: list[tuple[int, ...]], batches: range, native=None) -> None:
    for b in batches:
        for h, served in enumerate(hosts):
            for r in served:
                got = feeders[h].rows(b * layout.global_batch + r * layout.per_rank, layout.per_rank, r, None)
                if native is not None:
                    np.testing.assert_array_equal(got, native.rows(layout.rank_samples(b, r)))


@pytest.mark.parametrize("per_group", [3, 5])
def test_in_process_feeders_read_their_slices_once(tmp_path, per_group):
    """Feeders (the actor's class, in this process, engine threads) each serving some data
    shards: the rows equal the native reader's, each unit is read at most once per feeder,
    and together they read each consumed row group once more per slice boundary inside it."""
    rows = np.random.default_rng(1).integers(0, 300, size=(240, 9), dtype=np.int32)
    index = _write(tmp_path, rows, 60, per_group)
    native, g, layout = ParquetCorpus(str(tmp_path)), 24, BatchLayout(24, 1, 4)
    hosts = [(0, 2), (1,), (3,)]  # a host may serve slices that are not adjacent
    feeders = [_HostFeeder(str(tmp_path), {}, 2 * g, 3 * g, 2, 10.0, "threads") for _ in hosts]
    try:
        for f, served in zip(feeders, hosts):
            f.begin(StreamRequest("e0", 6 * g, g, 4, served))
        _consume(feeders, layout, hosts, range(6, 16), native)  # past the epoch's end (240 rows)
        stats = [f.get_stats() for f in feeders]
    finally:
        for f in feeders:
            f.close()
    table = UnitTable(index)
    for st, served in zip(stats, hosts):
        req = StreamRequest("e0", 6 * g, g, 4, served)
        wanted = [k for k in range(table.unit_of(6 * g), table.unit_of(19 * g)) if req.needs(*table.span(k))]
        assert st["units_read"] <= len(wanted)  # never a unit it does not need, never one twice
        assert st["bytes_read"] == st["index_bytes"] + st["footer_bytes"] + st["data_bytes"]
        assert st["rows_served"] == 10 * layout.per_rank * len(served)
    # 10 batches consumed, and at most 2 more read ahead (rows_ahead = 2 batches). Each of the
    # 4 slice boundaries of a batch that falls inside a row group makes 2 feeders read it.
    read = sum(st["rows_read"] for st in stats)
    assert read <= (10 + 2) * (g + 4 * per_group)
    if per_group == 3:  # groups divide every share (6 rows): every row is read once
        assert read <= (10 + 2) * g


@pytest.mark.parametrize("damage", ["row_group", "footer"])
def test_a_damaged_shard_fails_the_read_naming_it(tmp_path, damage):
    """A flipped byte in a row group's page (its CRC) or in a footer (its sha256 in the index)
    is an error for every rank that asks for those rows, never wrong rows."""
    rows = np.random.default_rng(2).integers(0, 300, size=(96, 9), dtype=np.int32)
    index = _write(tmp_path, rows, 48, 4)
    shard = index.shards[1]
    data = bytearray((tmp_path / shard.path).read_bytes())
    if damage == "footer":
        data[shard.footer_offset + 10] ^= 0x01
    else:
        meta = parse_footer(bytes(data[shard.footer_offset :]), shard.footer_sha256, shard.path)
        lo, hi = groups_span(meta, 2, 1)
        data[hi - 3] ^= 0xFF
    (tmp_path / shard.path).write_bytes(bytes(data))
    feeder = _HostFeeder(str(tmp_path), {}, 24, 24, 1, 10.0, "threads")
    try:
        feeder.begin(StreamRequest("e0", 0, 12, 1, (0,)))
        np.testing.assert_array_equal(feeder.rows(0, 12, 0, "e0"), rows[:12])  # shard 0 is sound
        with pytest.raises(RuntimeError, match="part-00001.parquet"):
            for b in range(1, 8):
                feeder.rows(b * 12, 12, 0, "e0")
    finally:
        feeder.close()
