"""Training data: a corpus of fixed-length token rows read in a DP-independent order.

The order is defined by a *global sample index*. Batch ``b`` (the b-th optimizer step's
data, counted from 0) is samples ``[b*G, (b+1)*G)`` of the corpus in file order, wrapping
around at the end (epochs repeat the same pre-shuffled order, as Megatron-style
preprocessed corpora do). DP rank ``r`` of ``dp`` takes the contiguous slice
``[r*G/dp, (r+1)*G/dp)`` of that batch, split into ``grad_accum`` micro-batches.

So batch ``b`` is the same set of samples whatever ``dp`` is, and each micro-batch's loss,
scaled by ``1/grad_accum`` and averaged by DP, is exactly the mean over the global batch.
The only training-state a resume needs is ``batch_index``: the next batch to read.

Reading is per DP rank with a bounded background prefetch (``prefetch_steps`` batches
ahead), from the replica's host reader for a corpus made by ``elastic prepare``
(``loader: ray_data``, the default, or ``feeder``; ``elastic/ingest/feeder.py``: one read per
host, through one long-lived Ray Data executor or the reader's own threads, staggered in
``data.waves``), by a thread that reads the parquet row groups itself (``loader: native``;
hosts start ``stagger_s * host_index`` apart) or from a Ray Data pipeline per rank
(``loader: ray_data`` on a corpus without an index), all in the same order. See docs/data.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from elastic.errors import LoaderTimeout
from elastic.ingest.parquet_corpus import TOKENS, ParquetCorpus
from elastic.parallel.batch import grad_accum

SOURCE_PROTOCOLS = ("file", "s3", "memory")  # the fsspec back ends this project installs and tests


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        "synthetic", description="'synthetic', a local path or a parquet URI (file://, s3://, memory://)"
    )
    num_samples: int = Field(20000, ge=1, description="corpus size for the synthetic source")
    cache_dir: str | None = Field(None, description="where the synthetic corpus is written; default <run_dir>/data")
    prefetch_steps: int = Field(2, ge=0, description="batches read ahead per rank")
    loader: Literal["auto", "feeder", "native", "ray_data"] = Field(
        "auto",
        description="ray_data: one reader per host shared by the ranks of a replica, reading through one "
        "long-lived Ray Data executor (a prepared corpus; otherwise a Ray Data pipeline per rank); feeder: the "
        "same host reader with its own read threads; native: a prefetch thread per rank; auto: ray_data for a "
        "prepared corpus (with index.json), native otherwise (docs/data.md)",
    )
    stagger_s: float = Field(0.05, ge=0, description="delay between hosts' first reads (native loader)")
    waves: int = Field(
        1,
        ge=1,
        description="hosts start reading in this many groups, at start-up and after "
        "every resize or restore (docs/data.md)",
    )
    max_reads_per_host: int = Field(
        2, ge=1, description="storage reads in flight per host (host readers, and checkpoint restore)"
    )
    storage_options: dict[str, Any] = Field(default_factory=dict)
    eval_source: str | None = Field(
        None,
        description="a corpus (local path or parquet URI) whose whole mean loss is the eval event's eval_loss, "
        "every train.eval_every steps; read by each rank's own reader, sharded over the data shards "
        "(docs/data.md)",
    )

    @field_validator("source", "eval_source")
    @classmethod
    def _source(cls, v: str | None) -> str | None:
        if v is None or v == "synthetic":
            return v
        protocol, sep, _ = v.partition("://")
        if not sep:
            return v  # a local path; whether it exists is checked by ``check_source_exists``
        if protocol not in SOURCE_PROTOCOLS:
            raise ValueError(
                f"protocol {protocol}:// is not supported; use one of " + ", ".join(f"{p}://" for p in SOURCE_PROTOCOLS)
            )
        return v

    def check_source_exists(self) -> None:
        """A local corpus (``file://`` or a path) must exist before anything starts. Remote
        sources are checked when read: their credentials may live only on the cluster."""
        import os

        from elastic.errors import SpecError

        for field, source in (("data.source", self.source), ("data.eval_source", self.eval_source)):
            if source is None or source == "synthetic":
                continue
            protocol, sep, rest = source.partition("://")
            if sep and protocol != "file":
                continue
            if not os.path.exists(rest if sep else source):
                raise SpecError(field, f"{source} does not exist")


# --------------------------------------------------------------------------- order (pure)


@dataclass(frozen=True)
class BatchLayout:
    """Which global samples a DP rank trains on; pure arithmetic, no I/O."""

    global_batch: int
    micro_batch: int
    dp: int

    @property
    def grad_accum(self) -> int:
        return grad_accum(self.global_batch, self.micro_batch, self.dp)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp

    def rank_samples(self, batch_index: int, dp_rank: int) -> np.ndarray:
        """Global sample indices of ``dp_rank``'s share of batch ``batch_index``."""
        start = batch_index * self.global_batch + dp_rank * self.per_rank
        return np.arange(start, start + self.per_rank, dtype=np.int64)

    def micro_batches(self, batch_index: int, dp_rank: int) -> list[np.ndarray]:
        return np.split(self.rank_samples(batch_index, dp_rank), self.grad_accum)


# --------------------------------------------------------------------------- corpus


def synthetic_corpus(cache_dir: str, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> str:
    """Write (once) a deterministic, learnable token corpus as parquet; return its URI.

    Rows follow a sparse random Markov chain (each token has a few likely successors), so a
    model can learn it and the loss falls well below ln(vocab) within a short run.
    """
    params = dict(n=num_samples, seq=seq_len, vocab=vocab_size, seed=seed, v=1)
    key = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    uri = f"{cache_dir.rstrip('/')}/synthetic-{key}"
    fs, path = fsspec.core.url_to_fs(uri)
    if fs.exists(f"{path}/_SUCCESS"):
        return uri
    rng = np.random.default_rng(seed)
    branching = 4
    successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
    probs = rng.dirichlet(np.full(branching, 0.5), size=vocab_size)
    cum = probs.cumsum(axis=1)
    rows = np.empty((num_samples, seq_len + 1), dtype=np.int32)
    rows[:, 0] = rng.integers(0, vocab_size, size=num_samples)
    for t in range(1, seq_len + 1):
        u = rng.random(num_samples)[:, None]
        choice = (u > cum[rows[:, t - 1]]).sum(axis=1).clip(max=branching - 1)
        rows[:, t] = successors[rows[:, t - 1], choice]
    fs.makedirs(path, exist_ok=True)
    rows_per_file = 8192
    for i, start in enumerate(range(0, num_samples, rows_per_file)):
        chunk = rows[start : start + rows_per_file]
        table = pa.table({TOKENS: pa.FixedSizeListArray.from_arrays(pa.array(chunk.reshape(-1)), seq_len + 1)})
        tmp, final = f"{path}/.part-{i:05d}.parquet.tmp", f"{path}/part-{i:05d}.parquet"
        with fs.open(tmp, "wb") as f:
            pq.write_table(table, f, row_group_size=1024)
        fs.mv(tmp, final)
    with fs.open(f"{path}/_SUCCESS", "wb") as f:
        f.write(json.dumps(params).encode())
    return uri


# --------------------------------------------------------------------------- per-rank stream


FIRST_BATCH_TIMEOUT_S = 60.0
PUT_POLL_S = 0.1  # how often a reader blocked on the full prefetch queue checks for a stop


class RankStream:
    """Yields ``(batch_index, [(inputs, targets), ...])`` for one DP rank, prefetched.

    A background thread reads up to ``prefetch`` batches ahead; the first read waits
    ``start_delay_s`` (the host's stagger slot). ``dp_rank`` is the rank's data shard (with
    expert parallelism each EP rank of a replica has its own, ``ParallelDims.data_shard``);
    ``seq_chunk = (cp, cp_rank)``: under context parallelism the rank gets its chunk of
    every sequence (``elastic.parallel.cp.sequence_slice``).
    """

    def __init__(
        self,
        corpus: ParquetCorpus | None,  # None when ``source`` delivers every batch
        layout: BatchLayout,
        dp_rank: int,
        start_batch: int,
        prefetch: int = 2,
        start_delay_s: float = 0.0,
        source: Iterator[tuple[int, np.ndarray]] | None = None,
        seq_chunk: tuple[int, int] = (1, 0),
        row_check: Callable[[np.ndarray, int], None] | None = None,
        loader: str = "native",
    ):
        import torch  # local: keeps `elastic.ingest.corpus` importable for pure planning code

        self._torch = torch
        self.corpus, self.layout, self.dp_rank = corpus, layout, dp_rank
        self._source = source  # (batch_index, rank rows) from a Ray Data pipeline, or None
        self.seq_chunk = seq_chunk
        self._row_check = row_check  # (rows, batch_index): raises CorpusError on rows that cannot train
        self.loader = loader  # its name in a LoaderTimeout
        self._failed_read_s = 0.0  # how long the read that raised took
        self.next_batch = self._first_batch = start_batch
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(start_batch, start_delay_s), daemon=True)
        self._thread.start()

    def _read(self, batch_index: int):
        if self._source is not None:
            got, rows = next(self._source)
            if got != batch_index:
                raise RuntimeError(f"Ray Data delivered batch {got}, expected {batch_index}")
        else:
            if self.corpus is None:
                raise RuntimeError("RankStream has neither a corpus nor a source to read from")
            rows = np.concatenate(
                [self.corpus.rows(idx) for idx in self.layout.micro_batches(batch_index, self.dp_rank)]
            )
        from elastic.parallel.cp import sequence_slice

        columns = self.corpus.columns if self.corpus is not None else (TOKENS,)
        if len(columns) > 1:  # SFT rows: tokens, loss_mask and/or document_ids side by side
            return self._sft_micro_batches(rows, columns, batch_index)
        if self._row_check is not None:
            self._row_check(rows, batch_index)
        rows = sequence_slice(rows, *self.seq_chunk)
        tokens = self._torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in tokens.split(self.layout.micro_batch)]

    def _sft_micro_batches(self, rows: np.ndarray, columns: tuple[str, ...], batch_index: int) -> list[tuple]:
        """``(inputs, targets, document_ids)`` per micro-batch: targets that do not count are
        ``IGNORE``, ``document_ids`` those of the inputs (``None`` without the column)."""
        from elastic.ingest.sft_rows import SftRows, check_columns, split_columns
        from elastic.parallel.cp import sequence_slice

        sft = split_columns(rows, columns)
        if self._row_check is not None:
            self._row_check(sft.tokens, batch_index)
        check_columns(sft, f"batch {batch_index}")
        cut = [
            None if x is None else sequence_slice(x, *self.seq_chunk)
            for x in (sft.tokens, sft.loss_mask, sft.document_ids)
        ]
        sft = SftRows(*cut)  # type: ignore[arg-type]  # tokens is never None
        torch = self._torch
        tokens = torch.from_numpy(np.ascontiguousarray(sft.tokens))
        targets = torch.from_numpy(np.ascontiguousarray(sft.targets()))
        docs = None if sft.document_ids is None else torch.from_numpy(np.ascontiguousarray(sft.document_ids[:, :-1]))
        mb = self.layout.micro_batch
        return [
            (
                tokens[i : i + mb, :-1].contiguous(),
                targets[i : i + mb].contiguous(),
                None if docs is None else docs[i : i + mb],
            )
            for i in range(0, len(tokens), mb)
        ]

    def _run(self, batch_index: int, delay: float) -> None:
        if delay > 0 and self._stop.wait(delay):
            return
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                item = (batch_index, self._read(batch_index))
            except Exception as exc:  # surfaced to the consumer, never swallowed
                item = (batch_index, exc)
                self._failed_read_s = time.monotonic() - t0  # read by next() after the item (queue order)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=PUT_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item[1], Exception):
                return
            batch_index += 1

    def next(self, timeout: float = 120.0):
        """The next batch; ``TimeoutError`` when none came within ``timeout`` seconds. The
        first batch of a stream gets at least ``FIRST_BATCH_TIMEOUT_S``: it includes opening
        the corpus cold (imports, footers), which a loaded host can stretch well past a
        collective's bound."""
        if self.next_batch == self._first_batch:
            timeout = max(timeout, FIRST_BATCH_TIMEOUT_S)
        try:
            batch_index, payload = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise self._timed_out(timeout) from None
        if isinstance(payload, TimeoutError) and not isinstance(payload, LoaderTimeout):  # the read's own bound
            raise self._timed_out(self._failed_read_s, f"{type(payload).__name__}: {payload}") from payload
        if isinstance(payload, Exception):
            raise payload
        assert batch_index == self.next_batch, (batch_index, self.next_batch)
        self.next_batch += 1
        return batch_index, payload

    def _timed_out(self, waited_s: float, why: str = "") -> LoaderTimeout:
        """No batch: the loader's read hangs (or timed out itself, ``why``). Named, with where
        and how long (``elastic.errors.LoaderTimeout``), never a bare timeout."""
        return LoaderTimeout(self.loader, socket.gethostname(), self.dp_rank, self.next_batch, round(waited_s, 1), why)

    def close(self) -> None:
        self._stop.set()
        # A reader blocked on the full queue would otherwise notice the stop only at its
        # put's timeout (PUT_POLL_S), on every re-formation's critical path: 3-87 ms per rank
        # in one 4-rank DDP recovery here, which the peers' rendezvous then waited for.
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join(timeout=5)
        close = getattr(self._source, "close", None)
        if close is not None and not self._thread.is_alive():  # a generator: its reader is told
            close()


# --------------------------------------------------------------------------- Ray Data


class _RankRowReader:
    """Ray Data map stage: batch index -> this DP rank's rows of that batch.

    A callable class, so the stage's actor opens the corpus once and keeps its row-group
    cache across batches.
    """

    def __init__(self, uri: str, storage_options: dict[str, Any], layout: BatchLayout, dp_rank: int):
        self.corpus = ParquetCorpus(uri, storage_options)
        self.layout, self.dp_rank = layout, dp_rank

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = [self.corpus.rows(self.layout.rank_samples(int(b), self.dp_rank)) for b in batch["batch_index"]]
        return {"batch_index": batch["batch_index"], "rows": np.stack(rows)}


def ray_data_batches(
    uri: str,
    storage_options: dict[str, Any],
    layout: BatchLayout,
    dp_rank: int,
    start_batch: int,
    num_batches: int,
    prefetch: int,
) -> Iterator[tuple[int, np.ndarray]]:
    """Stream ``dp_rank``'s batches ``start_batch..`` through a Ray Data pipeline, in order.

    The pipeline is defined by the same global sample order as the native reader, so a
    resume at any DP degree starts it at ``batch_index`` and reads exactly the next
    samples. Its reader runs as a zero-CPU actor: the training workers hold the CPUs.
    """
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    items = [{"batch_index": b} for b in range(start_batch, start_batch + num_batches)]
    ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items), 64))).map_batches(
        _RankRowReader,
        fn_constructor_kwargs={"uri": uri, "storage_options": storage_options, "layout": layout, "dp_rank": dp_rank},
        batch_size=1,
        concurrency=1,
        num_cpus=0,
    )
    for batch in ds.iter_batches(batch_size=1, prefetch_batches=max(1, prefetch), batch_format="numpy"):
        yield int(batch["batch_index"][0]), batch["rows"][0]
