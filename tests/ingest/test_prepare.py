"""``elastic prepare``: text -> packed token rows, deterministic, with its index; bad input exits 2."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from elastic.ingest import tokenizer as toks
from elastic.ingest.index import read_index
from elastic.ingest.prepare import PrepareConfig, prepare
from elastic.ingest.sidecar import read_sidecar
from elastic.testing.texts import stdlib_texts, write_jsonl
from jobs.cli import main as cli_main

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def docs():
    return stdlib_texts(("json",))


@pytest.fixture
def jsonl(tmp_path, docs):
    write_jsonl(str(tmp_path / "in"), docs)
    return str(tmp_path / "in")


def _rows(root: str) -> np.ndarray:
    index = read_index(root)
    return np.concatenate([np.asarray(pq.read_table(index.uri(s)).column("tokens").to_pylist()) for s in index.shards])


def test_byte_packing_matches_a_plain_loop(ray_local, jsonl, docs, tmp_path):
    out = str(tmp_path / "out")
    res = prepare(PrepareConfig(jsonl, out, tokenizer="byte", seq_len=31, rows_per_shard=100, progress=False))
    # The known answer: every document's UTF-8 bytes then end-of-text (256), cut into rows of 32.
    stream = np.concatenate([np.append(np.frombuffer(t.encode(), dtype=np.uint8), 256) for _, t in docs])
    n = len(stream) // 32
    n -= n % 8  # the tail that does not fill a row group (8 rows) is dropped too
    rows = _rows(out)
    assert rows.shape == (n, 32) and res.rows == n and res.docs == len(docs)
    np.testing.assert_array_equal(rows, stream[: n * 32].reshape(n, 32))
    index = json.load(open(f"{out}/index.json"))
    assert index["seq_len"] == 31 and index["tokenizer"]["kind"] == "byte" and index["tokenizer"]["eot_id"] == 256
    assert [s["rows"] for s in index["shards"]] == [100] * (n // 100) + ([n % 100] if n % 100 else [])
    assert all(len(s["sha256"]) == 64 for s in index["shards"])
    # Version 3: each shard's footer is where the index says, with its digest; groups of 8 rows;
    # its sidecar next to it reads back as the shard's rows, group by group.
    assert index["version"] == 3
    at = 0
    for s, shard in zip(index["shards"], read_index(out).shards):
        data = open(f"{out}/{s['path']}", "rb").read()
        assert s["footer_offset"] + s["footer_bytes"] == len(data) == s["bytes"] and s["rows_per_group"] == 8
        assert hashlib.sha256(data[s["footer_offset"] :]).hexdigest() == s["footer_sha256"]
        meta = pq.read_metadata(f"{out}/{s['path']}")
        groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        assert groups == [8] * (s["rows"] // 8) + ([s["rows"] % 8] if s["rows"] % 8 else [])
        side = open(f"{out}/{s['groups_path']}", "rb").read()
        assert s["groups_path"] == s["path"].replace(".parquet", ".groups") and len(side) == s["groups_bytes"]
        np.testing.assert_array_equal(read_sidecar(side, shard, data), rows[at : at + s["rows"]])
        at += s["rows"]


def test_output_does_not_depend_on_parallelism(ray_local, jsonl, tmp_path):
    shas = []
    for blocks in (1, 5):
        out = str(tmp_path / f"out{blocks}")
        prepare(
            PrepareConfig(jsonl, out, tokenizer="bpe:400", seq_len=64, rows_per_shard=64, blocks=blocks, progress=False)
        )
        raw = open(f"{out}/index.json", "rb").read()
        index = json.loads(raw)
        sides = [hashlib.sha256(open(f"{out}/{s['groups_path']}", "rb").read()).hexdigest() for s in index["shards"]]
        shas.append(([s["sha256"] for s in index["shards"]], sides, hashlib.sha256(raw).hexdigest()))
    assert shas[0] == shas[1] and len(shas[0][0]) > 3


def test_bpe_trains_on_the_input_and_round_trips(ray_local, jsonl, docs, tmp_path):
    out = str(tmp_path / "bpe")
    res = prepare(PrepareConfig(jsonl, out, tokenizer="bpe:600", seq_len=128, rows_per_shard=1000, progress=False))
    tok = toks.load_file(f"{out}/tokenizer.json")
    assert 300 < tok.get_vocab_size() <= 600 and res.index.tokenizer["vocab_size"] == tok.get_vocab_size()
    eot = toks.eot_id(tok)
    stream = _rows(out).reshape(-1)
    first = stream[: int(np.argmax(stream == eot))]
    assert tok.decode(first.tolist()) == docs[0][1]  # byte-level BPE decodes back to the text exactly
    # A saved tokenizer.json is a valid --tokenizer PATH, and gives the same ids.
    again = str(tmp_path / "again")
    prepare(PrepareConfig(jsonl, again, tokenizer=f"{out}/tokenizer.json", seq_len=128, progress=False))
    np.testing.assert_array_equal(_rows(again), _rows(out))


@pytest.mark.parametrize(
    "case, field",
    [
        ("missing_field", "--text-field"),
        ("empty_input", "INPUT"),
        ("bad_tokenizer", "--tokenizer"),
        ("bad_group", "--rows-per-group"),
    ],
)
def test_bad_input_exits_2_with_one_line(ray_local, jsonl, tmp_path, capsys, case, field):
    args = ["prepare", jsonl, str(tmp_path / "out")]
    if case == "missing_field":
        args += ["--text-field", "body"]
    elif case == "bad_group":
        args += ["--rows-per-shard", "16", "--rows-per-group", "17"]
    elif case == "empty_input":
        (tmp_path / "empty").mkdir()
        args[1] = str(tmp_path / "empty")
    else:
        bad = tmp_path / "tokenizer.json"
        bad.write_text("{not json")
        args += ["--tokenizer", str(bad)]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}:"), err
