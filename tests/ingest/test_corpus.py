"""The DP-independent sample order and the parquet corpus, without Ray."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic.ingest.corpus import BatchLayout, ParquetCorpus, RankStream, synthetic_corpus

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 6])
def test_batch_is_the_same_samples_at_any_dp(dp):
    layout = BatchLayout(global_batch=24, micro_batch=2, dp=dp)
    for batch in (0, 5):
        got = np.concatenate([layout.rank_samples(batch, r) for r in range(dp)])
        assert got.tolist() == list(range(batch * 24, batch * 24 + 24))
        assert all(len(mb) == 2 for r in range(dp) for mb in layout.micro_batches(batch, r))
        assert layout.grad_accum * dp * 2 == 24


def test_user_parquet_file_uri_with_random_access(tmp_path):
    rows = np.arange(30 * 5, dtype=np.int64).reshape(30, 5)
    for i, part in enumerate(np.split(rows, 3)):
        pq.write_table(pa.table({"tokens": [list(r) for r in part]}), tmp_path / f"p{i}.parquet", row_group_size=4)
    corpus = ParquetCorpus(f"file://{tmp_path}")
    assert corpus.num_rows == 30
    idx = np.array([29, 0, 13, 31])  # 31 wraps to row 1: epochs repeat the order
    assert corpus.rows(idx).tolist() == [rows[29].tolist(), rows[0].tolist(), rows[13].tolist(), rows[1].tolist()]


def test_synthetic_corpus_is_deterministic_and_cached(tmp_path):
    a = synthetic_corpus(str(tmp_path / "a"), 500, 8, 32, seed=3)
    b = synthetic_corpus(str(tmp_path / "b"), 500, 8, 32, seed=3)
    c = synthetic_corpus(str(tmp_path / "a"), 500, 8, 32, seed=4)
    ra, rb, rc = (ParquetCorpus(u).rows(np.arange(500)) for u in (a, b, c))
    assert (ra == rb).all() and not (ra == rc).all()
    assert synthetic_corpus(str(tmp_path / "a"), 500, 8, 32, seed=3) == a
    assert ra.shape == (500, 9) and ra.max() < 32


def test_rank_stream_prefetches_in_order_and_surfaces_errors(tmp_path):
    uri = synthetic_corpus(str(tmp_path), 200, 8, 32, seed=0)
    corpus = ParquetCorpus(uri)
    layout = BatchLayout(global_batch=8, micro_batch=2, dp=2)
    stream = RankStream(corpus, layout, dp_rank=1, start_batch=3, prefetch=2)
    for expected in (3, 4, 5):
        batch, mbs = stream.next(timeout=10)
        assert batch == expected and len(mbs) == 2
        want = corpus.rows(layout.micro_batches(batch, 1)[0])
        assert mbs[0][0].tolist() == want[:, :-1].tolist() and mbs[0][1].tolist() == want[:, 1:].tolist()
    stream.close()
    broken = RankStream(corpus, BatchLayout(8, 2, 2), 0, 0, source=iter([(7, np.zeros((4, 9)))]))
    with pytest.raises(RuntimeError, match="expected 0"):
        broken.next(timeout=10)
    broken.close()


def test_closing_a_stream_does_not_wait_for_its_reader_to_poll(tmp_path, monkeypatch):
    """A re-formation closes every rank's stream: a reader blocked on the full queue must
    stop at once, not at its put's next timeout (made 60 s here, beyond close's 5 s join)."""
    import elastic.ingest.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "PUT_POLL_S", 60.0)
    corpus = ParquetCorpus(synthetic_corpus(str(tmp_path), 64, 8, 50, seed=0))
    stream = RankStream(corpus, BatchLayout(8, 2, 2), dp_rank=0, start_batch=0, prefetch=1)
    stream.next()  # the reader has put batch 0 and is now blocked on batch 2's put (queue of 1)
    deadline = time.monotonic() + 10
    while stream._queue.qsize() < 1 and time.monotonic() < deadline:  # batch 1 is in, the next put blocks
        time.sleep(0.01)
    stream.close()
    assert not stream._thread.is_alive()
