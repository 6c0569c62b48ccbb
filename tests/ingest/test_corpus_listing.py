"""Hidden files in a corpus or an input directory are not data (issue 48, L18): a name
starting with ``.`` or ``_``, as Arrow, Spark and Hive treat it, is left out wherever a
directory is listed (``elastic.ingest.listing``): the driver's corpus check, every reader's
``ParquetCorpus``, and ``elastic prepare``'s input; on a local disk and an object store alike
(fsspec's ``memory://`` stands for S3 here: a flat namespace of keys). Pure, no Ray."""

from __future__ import annotations

import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic.errors import SpecError
from elastic.ingest.corpus import DataConfig
from elastic.ingest.parquet_corpus import ParquetCorpus
from elastic.ingest.preflight import check_corpus
from elastic.ingest.prepare import list_inputs

pytestmark = pytest.mark.timeout(60)

SEQ, VOCAB = 8, 50


def _table(rows: int, width: int = SEQ + 1) -> pa.Table:
    ids = np.arange(rows * width, dtype=np.int32).reshape(rows, width) % VOCAB
    return pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), width)})


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    """A corpus directory of one 16-row shard, beside hidden files that would not train:
    another width, no ``tokens`` column."""
    uri = str(tmp_path / "corpus") if request.param == "local" else f"memory://corpus-{uuid.uuid4().hex}"
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(path, exist_ok=True)
    files = {
        "part-00000.parquet": _table(16),
        ".part-00001.parquet": _table(1000, width=3),  # a hidden shard (a writer's half-done copy)
        "_part-00002.parquet": pa.table({"text": ["not tokens"]}),
        "_SUCCESS": None,
    }
    for name, table in files.items():
        with fs.open(f"{path}/{name}", "wb") as f:
            if table is not None:
                pq.write_table(table, f)
    yield uri
    if request.param == "memory":
        fs.rm(path, recursive=True)


def test_a_corpus_never_reads_its_hidden_files(root):
    corpus = ParquetCorpus(root)
    assert corpus.num_rows == 16 and [p.rsplit("/", 1)[-1] for p in corpus._meta] == ["part-00000.parquet"]
    assert corpus.rows(np.arange(16)).shape == (16, SEQ + 1)


def test_the_drivers_corpus_check_skips_hidden_files(root):
    assert check_corpus(DataConfig(source=root), SEQ, VOCAB) == ("tokens",)


def test_a_corpus_of_hidden_files_only_holds_no_parquet_file(root):
    fs, path = fsspec.core.url_to_fs(root)
    fs.rm(f"{path}/part-00000.parquet")
    with pytest.raises(SpecError) as err:
        check_corpus(DataConfig(source=root), SEQ, VOCAB)
    assert err.value.field == "data.source" and "holds no .parquet files" in str(err.value)
    with pytest.raises(FileNotFoundError):
        ParquetCorpus(root)


def test_prepare_skips_hidden_inputs_and_hidden_directories(tmp_path, monkeypatch):
    src = tmp_path / "in"
    for name in ("a.jsonl", "sub/b.jsonl", ".c.jsonl", "_d.jsonl", ".git/e.jsonl", "_tmp/f.jsonl", "sub/.g.jsonl"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text('{"text": "x"}\n')
    monkeypatch.chdir(tmp_path)
    for given in (str(src), str(src) + "/", f"file://{src}", "in", "./in/"):
        _, files = list_inputs(given)
        assert [f.removeprefix(str(src) + "/") for f in files] == ["a.jsonl", "sub/b.jsonl"], given
