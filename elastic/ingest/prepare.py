"""``elastic prepare``: raw text to a packed, tokenized parquet corpus, as a Ray Data pipeline.

Ray Data reads the input files (``file://`` or ``s3://``; JSON lines, parquet or plain
text) and tokenizes documents in parallel on the cluster's CPUs, in input order
(``preserve_order``). The driver then packs the token stream, each document followed by the
end-of-text token, into rows of ``seq_len + 1`` ids, cuts them into shards of
``rows_per_shard`` rows in row groups of ``rows_per_group`` (``elastic.ingest.shard_format``)
and writes each with its row-group sidecar (``elastic.ingest.sidecar``: every group's own
footer) and an index (``elastic.ingest.index``: version 3, which names both, so a host reader
fetches only the row groups it needs and their metadata). Packing is
sequential over an ordered stream, so the output is byte-identical whatever the cluster
size or the number of blocks. The tail shorter than one row is dropped. See docs/data.md.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elastic.errors import SpecError
from elastic.ingest import tokenizer as toks
from elastic.ingest.index import CorpusIndex, Shard, write_index
from elastic.ingest.listing import input_files
from elastic.ingest.sidecar import shard_entry
from storage import open_storage, redact_uri

FORMATS = ("jsonl", "parquet", "text")
# A replica's share of a batch (global_batch / dp) is typically 8 to 64 rows: groups of 8 let a
# host fetch about what it consumes, and keep the footer (about 100 bytes per group) small
# next to rows of a few KB (docs/data.md, "What a host reads").
ROWS_PER_GROUP = 8
_EXT = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "text", ".py": "text"}


@dataclass
class PrepareConfig:
    input: str
    output: str
    format: str | None = None
    text_field: str = "text"
    tokenizer: str = "byte"
    seq_len: int = 64
    rows_per_shard: int = 2048
    rows_per_group: int = ROWS_PER_GROUP  # rows per parquet row group: the unit a host reader fetches
    storage_options: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    blocks: int | None = None  # Ray Data read blocks (default: Ray's choice); the output does not depend on it
    overlong: str = "refuse"  # --format chat: a conversation longer than a row (elastic/ingest/row_packing.py)
    pack: bool = True  # --format chat: False puts one conversation in each row (the padding baseline)


@dataclass
class PrepareResult:
    docs: int
    tokens: int  # tokens in the packed rows (documents and end-of-text tokens)
    rows: int
    shards: int
    wall_s: float
    tokenize_s: float
    index: CorpusIndex

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def list_inputs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, list[str]]:
    """The input's filesystem and its files, sorted (hidden and ``_``-prefixed names, and
    what is under such a directory, skipped: ``elastic.ingest.listing``)."""
    protocol, sep, rest = uri.partition("://")
    if protocol == "s3":
        # Ray Data's read tasks run in other processes, possibly started before these variables
        # were set: hand them the driver's credentials explicitly (never logged).
        env = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN"}
        storage_options = dict(storage_options or {})
        for opt, var in env.items():
            if var in os.environ and opt not in storage_options:
                storage_options[opt] = os.environ[var]
    fs = open_storage(uri, storage_options).fs
    path = rest if sep else uri
    if protocol == "s3":
        path = path.rstrip("/")
    try:
        if fs.isdir(path):
            files = input_files(fs, path)
        elif fs.exists(path):
            files = [path]
        else:
            raise SpecError("INPUT", f"{redact_uri(uri)} does not exist")
    except (PermissionError, OSError) as exc:
        raise SpecError("INPUT", f"{redact_uri(uri)} cannot be read: {type(exc).__name__}") from None
    if not files:
        raise SpecError("INPUT", f"{redact_uri(uri)} holds no input files")
    return fs, files


BLOCK_BYTES = 8 << 20  # input bytes per Ray Data block when --blocks is not given


def _blocks(fs: Any, files: list[str]) -> int:
    """Read blocks: one per ``BLOCK_BYTES`` of input, at most one per cluster CPU. A small
    input is one block: each extra block is a task, and often a worker process, to start,
    which costs more than it saves below a few MB (docs/data.md, "Throughput")."""
    import ray

    try:
        size = sum(int(fs.size(f) or 0) for f in files)
    except (OSError, TypeError):
        return max(1, int(ray.cluster_resources().get("CPU", 1)))
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    return max(1, min(cpus, -(-size // BLOCK_BYTES)))


def infer_format(files: list[str], given: str | None) -> str:
    if given:
        if given not in FORMATS:
            raise SpecError("--format", f"{given!r} is not one of {', '.join(FORMATS)}")
        return given
    kinds = {_EXT.get(os.path.splitext(f)[1].lower()) for f in files}
    known = {k for k in kinds if k is not None}
    if len(kinds) != 1 or not known:
        raise SpecError("--format", "cannot tell the input format from the file names; pass --format")
    return known.pop()


def _dataset(fmt: str, fs: Any, files: list[str], text_field: str, blocks: int | None = None):
    """A Ray Data dataset with one column ``text``, in input order."""
    import ray.data
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    pafs = PyFileSystem(FSSpecHandler(fs))
    kw = {"filesystem": pafs, "override_num_blocks": blocks}
    if fmt == "jsonl":
        ds = ray.data.read_json(files, **kw)  # pyarrow reads JSON lines
    elif fmt == "parquet":
        ds = ray.data.read_parquet(files, **kw)
    else:  # one document per file
        ds = ray.data.read_binary_files(files, **kw)
        return ds.map_batches(_decode_files, batch_format="pyarrow")
    names = _field_names(fmt, fs, files)  # read here: a Ray Data schema() would run a whole read job
    if names is not None and text_field not in names:
        raise SpecError("--text-field", f"no field {text_field!r} in the input (fields: {', '.join(names) or 'none'})")
    return ds.select_columns([text_field]).rename_columns({text_field: "text"})


def _field_names(fmt: str, fs: Any, files: list[str]) -> list[str] | None:
    """The input's field names, from its first record (jsonl) or schema (parquet); None if none."""
    import json

    for f in files:
        with fs.open(f, "rb") as fh:
            if fmt == "parquet":
                return pq.read_schema(fh).names
            for line in fh:
                if line.strip():
                    try:
                        return list(json.loads(line))
                    except (ValueError, TypeError):
                        raise SpecError("INPUT", f"{f} is not JSON lines") from None
    return None


def _decode_files(batch: pa.Table) -> pa.Table:
    return pa.table({"text": [b.decode("utf-8", errors="replace") for b in batch.column("bytes").to_pylist()]})


_TOKENIZERS: dict[str, Any] = {}  # per worker process: tokenizer JSON -> (Tokenizer, end-of-text id)


def _tokenize(batch: pa.Table, tokenizer_json: str) -> pa.Table:
    """Ray Data map stage (a plain task: no actor to start): a block of documents -> one row
    holding their token ids as one flat array, each document followed by end-of-text.

    One flat array per block, not one list per document: the driver only needs the ordered
    stream, and Arrow handles one large list far faster than thousands of small ones.
    """
    if tokenizer_json not in _TOKENIZERS:  # worker processes are reused: load it once each
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tokenizer_json)
        _TOKENIZERS[tokenizer_json] = (tok, toks.eot_id(tok))
    tok, eot = _TOKENIZERS[tokenizer_json]
    texts = [t for t in batch.column("text").to_pylist() if t]  # null or empty documents are skipped
    eot_arr = np.asarray([eot], dtype=np.int32)
    parts: list[np.ndarray] = []
    for e in tok.encode_batch(texts, add_special_tokens=False) if texts else []:
        parts += [np.asarray(e.ids, dtype=np.int32), eot_arr]
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
    ids = pa.LargeListArray.from_arrays(pa.array([0, len(flat)], type=pa.int64()), pa.array(flat))
    return pa.table({"ids": ids, "docs": pa.array([len(texts)], type=pa.int64())})


def _tokenizer(cfg: PrepareConfig, spec: toks.TokenizerSpec, ds):
    if spec.kind == "byte":
        return toks.byte_tokenizer()
    if spec.kind == "file":
        tok = toks.load_file(spec.path)
        toks.eot_id(tok)
        return tok
    texts = (row["text"] for row in ds.iter_rows() if row["text"])
    return toks.train_bpe(texts, spec.vocab_size)


class _Packer:
    """Cuts an ordered token stream into rows of ``width`` and the rows into shards."""

    def __init__(self, width: int, rows_per_shard: int, write):
        self.width, self.rows_per_shard, self.write = width, rows_per_shard, write
        self._tail = np.empty(0, dtype=np.int32)
        self._rows: list[np.ndarray] = []
        self._buffered = 0
        self.rows = 0

    def add(self, ids: np.ndarray) -> None:
        flat = np.concatenate([self._tail, ids]) if len(self._tail) else ids
        n = len(flat) // self.width
        if n:
            self._rows.append(flat[: n * self.width].reshape(n, self.width))
            self._buffered += n
        self._tail = flat[n * self.width :].copy()
        while self._buffered >= self.rows_per_shard:
            block = np.concatenate(self._rows)
            self.write(block[: self.rows_per_shard])
            rest = block[self.rows_per_shard :]
            self._rows, self._buffered = ([rest] if len(rest) else []), len(rest)
            self.rows += self.rows_per_shard

    def finish(self, rows_per_group: int = 1) -> None:
        """Write the last shard. Its tail that does not fill a whole row group is dropped (fewer
        than ``rows_per_group`` rows, as the tail shorter than a row is), unless that would
        leave no row: each epoch then starts on a row-group boundary, so the hosts' slices stay
        aligned with the groups in every epoch (docs/data.md, "What a host reads")."""
        keep = self._buffered
        if self.rows + keep >= rows_per_group:
            keep -= (self.rows + keep) % rows_per_group
        if keep:
            self.write(np.concatenate(self._rows)[:keep])
            self.rows += keep
        self._rows, self._buffered = [], 0


def check_input(cfg: PrepareConfig) -> tuple[Any, list[str], str]:
    """Everything about the input and the options that can be checked without Ray (``SpecError``
    naming ``INPUT`` or the flag): returns the input's filesystem, files and format."""
    if cfg.seq_len < 1:
        raise SpecError("--seq-len", f"must be >= 1, got {cfg.seq_len}")
    if cfg.rows_per_shard < 1:
        raise SpecError("--rows-per-shard", f"must be >= 1, got {cfg.rows_per_shard}")
    if not 1 <= cfg.rows_per_group <= cfg.rows_per_shard:
        raise SpecError(
            "--rows-per-group", f"must be from 1 to --rows-per-shard ({cfg.rows_per_shard}), got {cfg.rows_per_group}"
        )
    tspec = toks.parse_tokenizer(cfg.tokenizer)
    if tspec.kind == "file":
        toks.eot_id(toks.load_file(tspec.path))
    fs, files = list_inputs(cfg.input, cfg.storage_options)
    fmt = infer_format(files, cfg.format)
    try:
        empty = sum(int(fs.size(f) or 0) for f in files) == 0
    except (OSError, TypeError):
        empty = False
    names = None if empty or fmt == "text" else _field_names(fmt, fs, files)
    if empty or (fmt != "text" and names is None):
        raise SpecError("INPUT", f"{redact_uri(cfg.input)} holds no documents (its files are empty)")
    if names is not None and cfg.text_field not in names:
        raise SpecError(
            "--text-field", f"no field {cfg.text_field!r} in the input (fields: {', '.join(names) or 'none'})"
        )
    if fmt != "parquet":
        _check_text_heads(fs, files, fmt)
    return fs, files, fmt


CHECKED_BYTES = 8 << 20  # of each jsonl/text file read before Ray starts (64 MiB in all at most)
CHECKED_TOTAL = 64 << 20


def _check_text_heads(fs: Any, files: list[str], fmt: str) -> None:
    """The first ``CHECKED_BYTES`` of each file (``CHECKED_TOTAL`` in all) are UTF-8 text with
    no NUL byte (a binary file was tokenized byte by byte), and, in JSON lines, every line an
    object: a ``SpecError`` on ``INPUT`` naming the file and line. Before, the first bad line
    failed inside a Ray Data task, a page of traceback."""
    import json

    budget = CHECKED_TOTAL
    for f in files:
        if budget <= 0:
            return
        with fs.open(f, "rb") as fh:
            head = fh.read(min(CHECKED_BYTES, budget))
            cut = len(head) == min(CHECKED_BYTES, budget)  # the last line may be cut short
        budget -= len(head)
        lines = head.split(b"\n")
        if cut:
            lines = lines[:-1]
        for n, line in enumerate(lines, 1):
            where = f"{redact_uri(f)} line {n}"
            if b"\0" in line:
                raise SpecError("INPUT", f"{where} holds a NUL byte: not text (a binary file?)")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SpecError("INPUT", f"{where} is not UTF-8 (byte {exc.start + 1})") from None
            if fmt != "jsonl" or not text.strip():
                continue
            try:
                record = json.loads(text)
            except ValueError:
                raise SpecError("INPUT", f"{where} is not JSON") from None
            if not isinstance(record, dict):
                raise SpecError("INPUT", f"{where} is not a JSON object (a {type(record).__name__})")


def prepare(cfg: PrepareConfig) -> PrepareResult:
    """Run the pipeline on the connected Ray cluster (``ray.init`` first). Nothing is left in
    ``cfg.output`` when it fails: what it wrote is removed; ``index.json`` comes last."""
    out = open_storage(cfg.output, cfg.storage_options)
    written: list[str] = []
    try:
        return _prepare(cfg, out, written)
    except BaseException:
        for uri in written:
            out.rm(uri)
        raise


def _prepare(cfg: PrepareConfig, out: Any, written: list[str]) -> PrepareResult:
    import ray.data

    t0 = time.perf_counter()
    fs, files, fmt = check_input(cfg)
    tspec = toks.parse_tokenizer(cfg.tokenizer)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ds = _dataset(fmt, fs, files, cfg.text_field, cfg.blocks or _blocks(fs, files))
    tok = _tokenizer(cfg, tspec, ds)
    described = toks.describe(tok, tspec.kind)
    shards: list[Shard] = []

    def put(name: str, data: bytes) -> None:
        uri = out.join(cfg.output, name)
        written.append(uri)
        out.put_bytes(uri, data)

    def write(rows: np.ndarray) -> None:
        data, side, shard = shard_entry(f"part-{len(shards):05d}.parquet", rows, cfg.rows_per_group)
        put(shard.path, data)
        put(str(shard.groups_path), side)
        shards.append(shard)

    packer = _Packer(cfg.seq_len + 1, cfg.rows_per_shard, write)
    tokenized = ds.map_batches(
        _tokenize, fn_kwargs={"tokenizer_json": tok.to_str()}, batch_format="pyarrow", batch_size=None
    )
    docs = 0
    progress = _Progress(cfg.progress)
    t_tok = time.perf_counter()
    for batch in tokenized.iter_batches(batch_format="pyarrow", batch_size=None):
        docs += int(pc.sum(batch.column("docs")).as_py() or 0)
        for chunk in batch.column("ids").chunks:
            packer.add(chunk.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False))
        progress.show(docs, packer.rows, len(shards), cfg.seq_len + 1, t0)
    packer.finish(cfg.rows_per_group)
    tokenize_s = time.perf_counter() - t_tok
    if docs == 0:
        raise SpecError("INPUT", f"{redact_uri(cfg.input)} holds no documents (field {cfg.text_field!r} is empty)")
    if packer.rows == 0:
        raise SpecError("--seq-len", f"the input has fewer than seq_len + 1 = {cfg.seq_len + 1} tokens")
    put("tokenizer.json", tok.to_str().encode())
    index = CorpusIndex(root=cfg.output, seq_len=cfg.seq_len, tokenizer=described, shards=tuple(shards))
    write_index(cfg.output, index, cfg.storage_options)  # last: the corpus is complete from here on
    wall = time.perf_counter() - t0
    progress.done()
    return PrepareResult(docs, packer.rows * (cfg.seq_len + 1), packer.rows, len(shards), wall, tokenize_s, index)


class _Progress:
    """One status line on stderr, refreshed at most twice a second (a new line when not a tty)."""

    def __init__(self, enabled: bool):
        self.enabled, self.last, self.tty = enabled, 0.0, sys.stderr.isatty()

    def show(self, docs: int, rows: int, shards: int, width: int, t0: float) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last = now
        tokens = rows * width
        line = f"prepare: {docs:,} docs, {tokens:,} tokens packed, {shards} shards, {tokens / (now - t0):,.0f} tokens/s"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled and self.tty and self.last:
            print(file=sys.stderr)


def iter_texts(uri: str, fmt: str | None = None, text_field: str = "text") -> Iterator[str]:
    """The input's documents in order, read in this process (the benchmark's baseline)."""
    import json

    fs, files = list_inputs(uri)
    fmt = infer_format(files, fmt)
    for f in files:
        with fs.open(f, "rb") as fh:
            if fmt == "jsonl":
                for line in fh:
                    if line.strip():
                        text = json.loads(line).get(text_field)
                        if text:
                            yield text
            elif fmt == "parquet":
                for t in pq.read_table(fh, columns=[text_field]).column(text_field).to_pylist():
                    if t:
                        yield t
            else:
                text = fh.read().decode("utf-8", errors="replace")
                if text:
                    yield text
