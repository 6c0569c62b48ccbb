"""What a host reader reads, without Ray: the units of the stream, which of them a host's
slices need (against brute force), the shard format's ranged reads and their checks (by
the footer, version 2; by the row-group sidecar, version 3), the index versions, and the
feeder's window in-process on real files (its reads, bytes and rows against the native
reader; its metadata bytes against the groups it reads)."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from elastic.ingest.corpus import BatchLayout, ParquetCorpus
from elastic.ingest.feeder import _HostFeeder
from elastic.ingest.index import CorpusIndex, Shard, parse_index, read_index
from elastic.ingest.shard_format import decode_groups, groups_span, parse_footer
from elastic.ingest.sidecar import (
    chunks_span,
    decode_run,
    parse_records,
    read_sidecar,
    record_digest,
    records_span,
)
from elastic.ingest.units import StreamRequest, UnitTable, served_slices
from elastic.testing.corpora import write_corpus

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


def _write(root, rows: np.ndarray, rows_per_shard: int, rows_per_group: int, version: int = 3) -> CorpusIndex:
    return write_corpus(str(root), rows, rows_per_shard, rows_per_group, version)


def test_row_groups_read_alone_are_verified(tmp_path):
    rows = np.random.default_rng(0).integers(0, 300, size=(50, 9), dtype=np.int32)
    index = _write(tmp_path, rows, 50, 4, version=2)
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


def test_row_groups_read_with_their_sidecar_records_are_verified(tmp_path):
    """Version 3: a run's records (one range of the sidecar) place its chunks (one range of the
    shard), and each group decodes from its chunk and mini-footer alone. A flipped byte in a
    chunk (page data or page header), in a mini-footer or in a record's fields, a record of
    another group or another shard: an error naming the shard, never wrong rows."""
    rows = np.random.default_rng(3).integers(0, 300, size=(50, 9), dtype=np.int32)
    index = _write(tmp_path, rows, 25, 4)
    shard, other = index.shards
    data, side = (tmp_path / shard.path).read_bytes(), (tmp_path / str(shard.groups_path)).read_bytes()
    assert index.version == 3 and shard.groups_bytes == len(side) == 16 + 7 * shard.groups_record_bytes
    np.testing.assert_array_equal(read_sidecar(side, shard, data), rows[:25])
    for first, count in ((0, 1), (2, 3), (6, 1), (0, 7)):
        lo, hi = records_span(shard, first, count)
        records = parse_records(side[lo:hi], shard, first, count)
        c_lo, c_hi = chunks_span(records)
        assert (c_lo, c_hi) == groups_span(pq.read_metadata(tmp_path / shard.path), first, count)
        got = decode_run(records, c_lo, data[c_lo:c_hi], shard)
        np.testing.assert_array_equal(got, rows[first * 4 : min(25, (first + count) * 4)])

    def run(side_bytes: bytes, data_bytes: bytes, first: int = 2, count: int = 2) -> np.ndarray:
        lo, hi = records_span(shard, first, count)
        records = parse_records(side_bytes[lo:hi], shard, first, count)
        c_lo, c_hi = chunks_span(records)
        return decode_run(records, c_lo, data_bytes[c_lo:c_hi], shard)

    lo, _ = records_span(shard, 3, 1)
    c_lo, c_hi = chunks_span(parse_records(side[lo : lo + shard.groups_record_bytes], shard, 3, 1))
    width = shard.groups_record_bytes
    for what, at in {
        "page data": c_hi - 3,
        "page header": c_lo + 2,  # not covered by the page's CRC: by the record's digest
        "chunk offset": lo,
        "chunk length": lo + 8,
        "mini-footer length": lo + 16,
        "rows": lo + 20,
        "digest": lo + 24,
        "mini-footer": lo + 40 + 20,
    }.items():
        bad = {"side": bytearray(side), "data": bytearray(data)}
        bad["data" if what.startswith("page") else "side"][at] ^= 0x01
        with pytest.raises(OSError, match="part-00000.parquet row group 3"):
            run(bytes(bad["side"]), bytes(bad["data"]))
    # A page damaged before its record was made (the record vouches for the bytes): its CRC.
    record = parse_records(side[lo : lo + width], shard, 3, 1)[0]
    chunk = bytearray(data[c_lo:c_hi])
    chunk[-3] ^= 0x01
    digest = record_digest(shard.sha256, 3, record.offset, record.length, record.rows, record.footer, bytes(chunk))
    with pytest.raises(OSError, match="row group 3: .*CRC"):
        decode_run([dataclasses.replace(record, digest=digest)], c_lo, bytes(chunk), shard)
    swapped = bytearray(side)  # group 3's record in group 2's place: its digest names group 3
    swapped[16 + 2 * width : 16 + 3 * width] = side[16 + 3 * width : 16 + 4 * width]
    with pytest.raises(OSError, match="part-00000.parquet row group 2"):
        run(bytes(swapped), data, count=1)
    other_side = (tmp_path / str(other.groups_path)).read_bytes()  # another shard's records
    with pytest.raises(OSError, match="part-00000.parquet row group"):
        run(other_side, data)


def test_older_indexes_read_as_they_were_written(tmp_path):
    """A version 3 index is version 2's plus the sidecars; versions 2 and 1 (an older
    ``elastic prepare``) parse back as themselves and are read by footer or whole shard."""
    rows = np.arange(40 * 5, dtype=np.int32).reshape(40, 5)
    index = _write(tmp_path, rows, 16, 4)
    raw = json.loads((tmp_path / "index.json").read_text())
    assert raw["version"] == 3 and raw["shards"][0]["groups_path"] == "part-00000.groups"
    assert read_index(str(tmp_path)) == index and all(s.sidecar for s in index.shards)
    for version, units in ((2, 4 + 4 + 2), (1, 3)):
        old = json.loads(json.dumps(index.as_version(version).to_json()))
        assert old["version"] == version and "groups_path" not in old["shards"][0]
        assert ("rows_per_group" in old["shards"][0]) is (version == 2)
        parsed = parse_index(str(tmp_path), json.dumps(old).encode())
        assert parsed.version == version and parsed == index.as_version(version)
        assert UnitTable(parsed).total_units == units and not any(s.sidecar for s in parsed.shards)
    raw["shards"][1].pop("groups_record_bytes")  # an entry missing a field is read as the version below
    assert [s.version for s in parse_index(str(tmp_path), json.dumps(raw).encode()).shards] == [3, 2, 3]
    raw["version"] = 4
    with pytest.raises(ValueError, match="newer than this reader"):
        parse_index(str(tmp_path), json.dumps(raw).encode())


def _consume(feeders, layout: BatchLayout, hosts: list[tuple[int, ...]], batches: range, native=None) -> None:
    for b in batches:
        for h, served in enumerate(hosts):
            for r in served:
                got = feeders[h].rows(b * layout.global_batch + r * layout.per_rank, layout.per_rank, r, None)
                if native is not None:
                    np.testing.assert_array_equal(got, native.rows(layout.rank_samples(b, r)))


@pytest.mark.parametrize("version", [2, 3])
def test_metadata_read_follows_the_groups_read_not_the_hosts(tmp_path, version):
    """One feeder per data shard, as on dp hosts, at dp 2, 4 and 8; 12 batches of 24 rows,
    groups of 3 rows (they divide every share, so the hosts together read each consumed group
    once). Version 3: each feeder reads one record (``W`` bytes) per group it reads and
    nothing else of metadata, so the hosts together read the same metadata at any dp, and
    what they read is at most ``(B + 2) / B * (1 + W / g)`` of the consumed groups' bytes
    (``B`` batches consumed and 2 read ahead, ``g`` the smallest group), plus the index.
    Version 2: each reads the footer of every shard its stream reaches: it grows with dp."""
    rows = np.random.default_rng(4).integers(0, 300, size=(480, 257), dtype=np.int32)
    index = _write(tmp_path, rows, 48, 3, version)
    g, batches, width = 24, 12, index.as_version(3).shards[0].groups_record_bytes or 0
    spans = [groups_span(pq.read_metadata(tmp_path / s.path), k, 1) for s in index.shards for k in range(16)]
    group_bytes = np.asarray([hi - lo for lo, hi in spans])
    meta, consumed_groups = {}, batches * g // 3
    for dp in (2, 4, 8):
        feeders = [_HostFeeder(str(tmp_path), {}, 2 * g, 3 * g, 2, 10.0, "threads") for _ in range(dp)]
        try:
            for r, f in enumerate(feeders):
                f.begin(StreamRequest("e0", 2 * g, g, dp, (r,)))
            _consume(feeders, BatchLayout(g, 1, dp), [(r,) for r in range(dp)], range(2, 2 + batches))
            stats = [f.get_stats() for f in feeders]
        finally:
            for f in feeders:
                f.close()
        meta[dp] = sum(st["footer_bytes"] for st in stats)
        units = sum(st["units_read"] for st in stats)
        assert consumed_groups <= units <= (batches + 2) * g // 3
        if version == 3:
            assert all(st["footer_bytes"] == width * st["units_read"] for st in stats)
            data = sum(st["data_bytes"] for st in stats)
            consumed = int(group_bytes[2 * g // 3 : (2 + batches) * g // 3].sum())
            assert (data + meta[dp]) / consumed <= (batches + 2) / batches * (1 + width / group_bytes.min())
        else:  # every feeder read the footers of the 6 shards that hold batches 2 .. 13
            footers = sum(s.footer_bytes or 0 for s in index.shards[1:7])
            assert meta[dp] >= dp * footers
    if version == 3:
        assert max(meta.values()) <= width * (batches + 2) * g // 3
    else:
        assert meta[8] > 3 * meta[2]


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


@pytest.mark.parametrize(
    "version, damage", [(2, "row_group"), (2, "footer"), (3, "row_group"), (3, "mini_footer"), (3, "no_sidecar")]
)
def test_a_damaged_shard_fails_the_read_naming_it(tmp_path, version, damage):
    """A flipped byte in a row group's chunk (version 2: its page's CRC; version 3: its
    record's digest), in a footer (version 2: its sha256 in the index) or in a group's
    mini-footer in the sidecar (version 3: its record's digest), or a sidecar that is not
    there, is an error naming the shard for every rank that asks for those rows, never
    wrong rows."""
    rows = np.random.default_rng(2).integers(0, 300, size=(96, 9), dtype=np.int32)
    index = _write(tmp_path, rows, 48, 4, version)
    shard = index.shards[1]
    data = bytearray((tmp_path / shard.path).read_bytes())
    side_path = tmp_path / str(index.as_version(3).shards[1].groups_path or "part-00001.groups")
    lo, hi = groups_span(pq.read_metadata(tmp_path / shard.path), 2, 1)
    if damage == "footer":
        data[shard.footer_offset + 10] ^= 0x01
    elif damage == "row_group":
        data[hi - 3] ^= 0xFF
    elif damage == "mini_footer":
        side = bytearray(side_path.read_bytes())
        side[records_span(shard, 2, 1)[0] + 40 + 10] ^= 0x01
        side_path.write_bytes(bytes(side))
    else:
        side_path.unlink()
    (tmp_path / shard.path).write_bytes(bytes(data))
    feeder = _HostFeeder(str(tmp_path), {}, 24, 24, 1, 10.0, "threads")
    try:
        feeder.begin(StreamRequest("e0", 0, 12, 1, (0,)))
        np.testing.assert_array_equal(feeder.rows(0, 12, 0, "e0"), rows[:12])  # shard 0 is sound
        with pytest.raises(RuntimeError, match="part-00001"):
            for b in range(1, 8):
                feeder.rows(b * 12, 12, 0, "e0")
    finally:
        feeder.close()


def test_a_stream_its_ranks_left_reads_no_further(tmp_path):
    """When a layout ends, its ranks close their streams (``feeder_batches`` tells the feeder):
    the window stops where it is, so the next layout's waves do not meet the old layout's
    read-ahead. A release naming another stream changes nothing."""
    rows = np.random.default_rng(6).integers(0, 300, size=(480, 9), dtype=np.int32)
    index = _write(tmp_path, rows, 48, 3)
    g = 24
    feeder = _HostFeeder(str(tmp_path), {}, 4 * g, 5 * g, 1, 10.0, "threads")
    try:
        feeder.begin(StreamRequest("e0", 0, g, 1, (0,)))
        for b in range(9):  # past the first window (8 batches): the window now reaches batch 12
            feeder.rows(b * g, g, 0, "e0")
        feeder.release(0, "e1")
        feeder.release(0, "e0")
        time.sleep(0.5)  # the read in flight lands; no other starts
        held = feeder.get_stats()["units_read"]
        time.sleep(0.3)
        assert feeder.get_stats()["units_read"] == held < UnitTable(index).unit_of(12 * g)
    finally:
        feeder.close()


def test_a_window_goes_on_within_its_reach_from_the_first_unit_it_needs(tmp_path):
    """Whether a new layout's stream goes on: the stream's reach decides (the last unit held
    or being read), not the scan, which moves only when the next read is planned (with
    engine ray_data, when the executor asks); and a host that gets a slice back needs the
    units from its first needed one, not from the batch's start."""
    from elastic.ingest.feeder_window import FeederWindow

    rows = np.random.default_rng(8).integers(0, 300, size=(480, 9), dtype=np.int32)
    g, index = 24, _write(tmp_path, rows, 48, 3)
    w = FeederWindow(2 * g, 3 * g)
    w.request, w.low_default = StreamRequest("e1", 6 * g, g, 3, (2,)), 6 * g
    w.set_index(index)
    t = w.table
    for b in range(6, 12):  # slice 2 of batches 6..11 read, the next read not planned yet
        for k in range(t.unit_of(b * g + 16), t.unit_of(b * g + 23) + 1):
            w.units[k] = rows[:3]
    w.scan = t.unit_of(11 * g + 16)
    w.request = StreamRequest("e2", 12 * g, g, 4, (2, 3))  # the host gets slice 3 back
    assert w.can_go_on(12 * g)
    w.kept_from = t.unit_of(12 * g + 12)  # dropped up to the first row slices 2 and 3 need
    assert w.can_go_on(12 * g)
    w.kept_from += 1
    assert not w.can_go_on(12 * g)  # a needed unit is gone: a jump
    w.kept_from = 0
    assert not w.can_go_on(60 * g)  # far past the stream's reach: a jump
    # Slices 0 and 1 of 3 read up to batch 11's last row they need (its tail, slice 2's rows,
    # not read, the scan not past them yet): the next batch at dp 4 goes on.
    w.request, w.units = StreamRequest("e1", 6 * g, g, 3, (0, 1)), {}
    for b in range(6, 12):
        for k in range(t.unit_of(b * g), t.unit_of(b * g + 15) + 1):
            w.units[k] = rows[:3]
    w.scan = t.unit_of(11 * g + 15)
    w.request = StreamRequest("e2", 12 * g, g, 4, (0, 1))
    assert w.can_go_on(12 * g)
