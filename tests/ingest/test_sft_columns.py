"""The ``loss_mask`` and ``document_ids`` columns (docs/data.md): read beside ``tokens`` into
micro-batches whose uncounted targets are IGNORE, and a column of the wrong length or type
refused before anything starts, naming it (exit 2)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_testlib import run_cli

from elastic.errors import SpecError
from elastic.ingest.corpus import BatchLayout, DataConfig, RankStream
from elastic.ingest.parquet_corpus import ParquetCorpus
from elastic.ingest.preflight import check_corpus
from elastic.ingest.sft_rows import IGNORE

pytestmark = pytest.mark.timeout(60)

SEQ, VOCAB = 8, 50


def write(path, n=16, width=SEQ + 1, mask_width=None, docs_type=None, mask=None, fixed=True) -> str:
    docs_type = docs_type or pa.int32()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (n, width))
    loss_mask = mask if mask is not None else (rng.random((n, mask_width or width)) < 0.6).astype(np.int8)
    docs = np.repeat(np.arange(3), -(-width // 3))[None, :width].repeat(n, 0)

    def col(a, t):
        flat = pa.array(a.reshape(-1), type=t)
        if fixed:
            return pa.FixedSizeListArray.from_arrays(flat, a.shape[1])
        return pa.array([list(r) for r in a], type=pa.list_(t))

    table = pa.table(
        {
            "tokens": col(tokens, pa.int32()),
            "loss_mask": col(loss_mask, pa.int8()),
            "document_ids": col(docs, docs_type),
        }
    )
    path.mkdir(exist_ok=True)
    pq.write_table(table, path / "part-0.parquet", row_group_size=4)
    return str(path)


def test_rows_come_with_their_mask_and_documents(tmp_path):
    uri = write(tmp_path / "c")
    corpus = ParquetCorpus(uri)
    assert corpus.columns == ("tokens", "loss_mask", "document_ids")
    table = pq.read_table(f"{uri}/part-0.parquet")
    tokens, mask = (np.asarray(table.column(c).to_pylist()) for c in ("tokens", "loss_mask"))
    docs = np.asarray(table.column("document_ids").to_pylist())
    stream = RankStream(corpus, BatchLayout(global_batch=8, micro_batch=4, dp=2), dp_rank=1, start_batch=0)
    try:
        _, micro = stream.next(timeout=30)
    finally:
        stream.close()
    assert len(micro) == 1
    inputs, targets, doc_in = micro[0]
    rows = slice(4, 8)  # dp rank 1's half of batch 0
    np.testing.assert_array_equal(inputs.numpy(), tokens[rows, :-1])
    np.testing.assert_array_equal(doc_in.numpy(), docs[rows, :-1])
    counted = (mask[rows, 1:] == 1) & (docs[rows, 1:] == docs[rows, :-1])
    want = np.where(counted, tokens[rows, 1:], IGNORE)
    np.testing.assert_array_equal(targets.numpy(), want)
    assert (targets.numpy() == IGNORE).any() and (targets.numpy() != IGNORE).any()


def test_a_good_corpus_reports_its_columns(tmp_path):
    uri = write(tmp_path / "c", fixed=False)
    assert check_corpus(DataConfig(source=uri), SEQ, VOCAB) == ("tokens", "loss_mask", "document_ids")


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"mask_width": SEQ}, "column 'loss_mask' has rows of 8"),
        ({"mask_width": SEQ, "fixed": False}, "column 'loss_mask' holds 32 values in 4 rows"),
        ({"docs_type": pa.float32()}, "column 'document_ids' holds float, not integers"),
        ({"mask": np.full((16, SEQ + 1), 2, dtype=np.int8)}, "column 'loss_mask' holds values other than 0 and 1"),
    ],
    ids=["short-fixed", "short-lists", "float-docs", "mask-not-0-1"],
)
def test_a_bad_column_is_refused_naming_it(tmp_path, kw, words):
    uri = write(tmp_path / "c", **kw)
    with pytest.raises(SpecError) as err:
        check_corpus(DataConfig(source=uri), SEQ, VOCAB)
    assert err.value.field == "data.source" and words in str(err.value), str(err.value)


def test_elastic_run_refuses_it_before_anything_starts(tmp_path, capsys):
    uri = write(tmp_path / "c", mask_width=SEQ)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: {{kind: llama, n_layers: 1, d_model: 16, n_heads: 2}}\nrun_dir: {tmp_path / 'run'}\n")
    got = run_cli(
        capsys, "run", str(spec), "--set", f"model.seq_len={SEQ}", "--set",
        f"model.vocab_size={VOCAB}", "--set", f"data.source={uri}",
    )  # fmt: skip
    assert got.returncode == 2 and "loss_mask" in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr
