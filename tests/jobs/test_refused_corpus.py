"""A corpus that cannot train is refused before anything starts: one line naming
``data.source`` and the file, exit 2, no Ray and nothing written (docs/cli.md, docs/data.md),
on local disk and on S3 with the storage options as users write them."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from refusal_testlib import TINY_MODEL, refused, run_args, write_parquet

from elastic.testing.corpora import write_corpus

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_ray")]


def _corpora(root) -> dict[str, tuple[str, str]]:
    """name -> (data.source, what the one line must say)."""
    rng = np.random.default_rng(0)
    good = rng.integers(0, 64, size=(64, 17))
    write_parquet(f"{root}/wide/part-0.parquet", rng.integers(0, 64, size=(64, 34)))
    write_parquet(f"{root}/ids/part-0.parquet", rng.integers(0, 1000, size=(64, 17)))
    write_parquet(
        f"{root}/varlen/part-0.parquet", np.concatenate([good[:, :16], good[:, :17]], axis=1)[:, :33], fixed=False
    )
    pq.write_table(pa.table({"ids": pa.array([[1] * 17] * 4)}), f"{root}/column.parquet")
    os.makedirs(f"{root}/nofiles")
    (open(f"{root}/nofiles/README.txt", "w")).write("no parquet here")
    os.makedirs(f"{root}/empty")
    open(f"{root}/empty/part-0.parquet", "wb").close()
    os.makedirs(f"{root}/corrupt")
    open(f"{root}/corrupt/part-0.parquet", "wb").write(b"PAR1" + b"\0" * 64 + b"PAR1")
    pq.write_table(pa.table({"tokens": pa.array(["a", "b"])}), f"{root}/strings.parquet")
    write_parquet(f"{root}/indexed/part-00000.parquet", good)
    with open(f"{root}/indexed/index.json", "w") as f:
        json.dump({"seq_len": 32, "tokenizer": {"vocab_size": 64}, "shards": []}, f)
    write_corpus(f"{root}/nosidecar", good, 32, 8, vocab_size=64)  # version 3, one sidecar lost
    write_corpus(f"{root}/small", good[:40], 32, 8, vocab_size=64)  # fewer rows than quickstart's batch of 48
    os.remove(f"{root}/nosidecar/part-00001.groups")
    return {
        "wide": (f"{root}/wide", "part-0.parquet: rows of 34 ids; model.seq_len + 1 = 17"),
        "ids": (f"{root}/ids", "token ids from 0 to 999"),
        "varlen": (f"{root}/varlen", "every row needs model.seq_len + 1 = 17"),
        "column": (f"file://{root}/column.parquet", "has no 'tokens' column (columns: ids)"),
        "nofiles": (f"{root}/nofiles", "holds no .parquet files"),
        "empty": (f"{root}/empty", "part-0.parquet is not a readable parquet file"),
        "corrupt": (f"{root}/corrupt", "part-0.parquet is not a readable parquet file"),
        "strings": (f"{root}/strings.parquet", "not a list of token ids"),
        "indexed": (f"{root}/indexed", "was prepared with --seq-len 32"),
        "nosidecar": (f"{root}/nosidecar", "nosidecar/part-00001.groups (the row-group sidecar of part-00001.parquet)"),
        "small": (f"{root}/small", "40 rows are fewer than one batch (train.global_batch=48)"),
    }


def test_a_corpus_that_cannot_train_is_refused_naming_the_file(capsys, tmp_path):
    for name, (source, says) in _corpora(str(tmp_path / "corpora")).items():
        line = refused(capsys, run_args(tmp_path, *TINY_MODEL, f"data.source={source}"), "data.source")
        assert says in line, (name, line)
    assert not (tmp_path / "run").exists()


def test_a_corpus_on_s3_is_checked_with_our_storage_options(capsys, tmp_path, moto_s3, s3_bucket):
    """The options as users write them (``region``, ``endpoint_url``) reach s3fs translated: the
    driver reads the corpus on S3 and refuses it, where s3fs once raised a TypeError on
    ``region`` and the check was skipped with a warning."""
    corpora = _corpora(str(tmp_path / "corpora"))
    opts = json.dumps(moto_s3.options())
    for name in ("wide", "indexed"):
        local, says = corpora[name]
        for f in os.listdir(local):
            moto_s3.client().upload_file(os.path.join(local, f), s3_bucket, f"{name}/{f}")
        source = f"s3://{s3_bucket}/{name}"
        line = refused(
            capsys,
            run_args(tmp_path, *TINY_MODEL, f"data.source={source}", f"data.storage_options={opts}"),
            "data.source",
        )
        assert says in line, (name, line)
    assert not (tmp_path / "run").exists()
