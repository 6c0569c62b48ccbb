"""The corpus checked before anything starts (driver side; ``ElasticTrainer.fit`` calls
:func:`check_corpus` before Ray starts).

A corpus that cannot train (no parquet files, a corrupt or empty file, no ``tokens``
column, rows of other than ``model.seq_len + 1`` ids, ids outside ``[0,
model.vocab_size)``) fails every rank the same way on every retry; found here it is one
line naming ``data.source`` and the file (exit 2), and no failure budget is spent.

Cheap at any corpus size: a prepared corpus's ``index.json`` (its ``seq_len`` and
vocabulary; with a version 3 index, the size of up to ``MAX_FOOTERS`` of its row-group
sidecars), the footers of at most ``MAX_FOOTERS`` files (the first, the last and evenly
spaced ones between: schema, row count, each row group's min and max id from the column
statistics when the file has them (``elastic prepare`` writes none: its index's vocabulary
is checked instead) and its value count), and ``SAMPLE_ROWS`` rows of the first file read
for real.
What the sample cannot see is caught as it is read (``RankStream``: a ``CorpusError``,
which ends the job at once rather than being retried).

The optional SFT columns (``loss_mask``, ``document_ids``: ``elastic/ingest/sft_rows.py``) are
checked the same way: lists of integers ``model.seq_len + 1`` long, in every file or none,
``loss_mask`` 0 or 1 in the sample; the error names the column. ``check_sft_layout`` refuses
a layout or model that cannot train on them.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from elastic.errors import CorpusError, SpecError
from elastic.ingest.corpus import TOKENS
from elastic.ingest.index import CorpusIndex, read_index
from elastic.ingest.listing import corpus_files
from elastic.ingest.parquet_corpus import DOCUMENT_IDS, LOSS_MASK, SFT_COLUMNS
from storage import redact_uri, url_to_fs

log = logging.getLogger(__name__)

MAX_FOOTERS = 64
T = TypeVar("T")
SAMPLE_ROWS = 256


def check_corpus(
    data: Any, seq_len: int, vocab_size: int, source: str | None = None, field: str = "data.source"
) -> tuple[str, ...]:
    """``SpecError`` on ``field`` when the corpus cannot train this model (see the module
    docstring); returns its columns (``tokens`` first). A remote corpus the driver cannot
    reach (credentials only on the cluster) is left to the readers, with a warning.
    ``source``: another corpus than ``data.source`` (``data.eval_source``), named ``field``."""
    if source is None and data.source == "synthetic":
        return (TOKENS,)
    try:
        return _check_corpus(data, seq_len, vocab_size, source or data.source)
    except SpecError as exc:
        if field == "data.source":
            raise
        raise SpecError(field, exc.message if hasattr(exc, "message") else str(exc)) from None


def check_eval_corpus(spec: Any, seq_len: int, vocab_size: int) -> None:
    """``data.eval_source``, when set, checked as ``data.source`` is (rows of ``seq_len + 1``
    ids below ``vocab_size``: an eval corpus with another row width is refused), and its
    ``document_ids`` only for a model that takes them; errors name ``data.eval_source``.
    Each rank reads it with its own reader, whatever ``data.loader`` says."""
    source = spec.data.eval_source
    if source is None:
        return
    columns = check_corpus(spec.data, seq_len, vocab_size, source=source, field="data.eval_source")
    if DOCUMENT_IDS in columns:
        from elastic.models.spec import model_spec

        if not model_spec(spec.model).documents:
            raise SpecError(
                "data.eval_source",
                f"the corpus has a '{DOCUMENT_IDS}' column; model {spec.model.kind!r} takes no document ids",
            )


def check_batch_fits(data: Any, global_batch: int) -> None:
    """A corpus of fewer rows than one global batch (synthetic, or prepared with an index) is
    a ``SpecError``: every batch would hold some rows twice, and nothing said so."""
    if data.source == "synthetic":
        rows, field = data.num_samples, "data.num_samples"
    else:
        try:
            index = read_index(data.source, data.storage_options)
        except Exception:  # noqa: BLE001 - check_corpus has reported an index it cannot read
            return
        if index is None:
            return
        rows, field = index.num_rows, "data.source"
    if rows < global_batch:
        raise SpecError(
            field,
            f"{rows} rows are fewer than one batch (train.global_batch={global_batch}): "
            "each batch would hold rows twice; a larger corpus or a smaller train.global_batch",
        )


def check_sft_layout(columns: tuple[str, ...], spec: Any) -> None:
    """A corpus with ``document_ids`` needs a model whose forward takes them, and no pipeline
    or context parallelism (their stages and chunks carry no document ids); a corpus with
    SFT columns is read by the rank's own reader (``data.loader: native``, which ``auto`` is
    when its index names the columns) when it has an index (the host readers read ``tokens``
    alone)."""
    if len(columns) == 1:
        return
    if DOCUMENT_IDS in columns:
        from elastic.models.spec import model_spec

        if spec.parallel.pp > 1:
            raise SpecError("parallel.pp", f"the corpus has a '{DOCUMENT_IDS}' column: packed rows need parallel.pp=1")
        if spec.parallel.cp > 1:
            raise SpecError("parallel.cp", f"the corpus has a '{DOCUMENT_IDS}' column: packed rows need parallel.cp=1")
        if not model_spec(spec.model).documents:
            raise SpecError(
                "model.kind",
                f"the corpus has a '{DOCUMENT_IDS}' column; model {spec.model.kind!r} takes no document ids",
            )
    if spec.data.loader in ("feeder", "ray_data") or (spec.data.loader == "auto" and _host_read(spec.data)):
        raise SpecError(
            "data.loader",
            f"the corpus has {', '.join(c for c in columns if c != TOKENS)} beside tokens, which only the rank's own "
            "reader reads: set data.loader=native",
        )


def _host_read(data: Any) -> bool:
    """Whether ``data.loader: auto`` picks the host readers: an index that does not name the
    SFT columns (one ``elastic prepare --format chat`` wrote does: ``auto`` is then native)."""
    try:
        index = read_index(data.source, data.storage_options)
        return index is not None and index.host_readable
    except Exception:  # noqa: BLE001 - unreadable: check_corpus said so already
        return False


def _check_corpus(data: Any, seq_len: int, vocab_size: int, source: str) -> tuple[str, ...]:
    data = data.model_copy(update={"source": source})
    try:
        fs, files, is_dir = _parquet_files(data.source, data.storage_options)
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - remote and unreachable from here: checked when read
        if "://" in data.source and not data.source.startswith("file://"):
            log.warning("data.source not checked from the driver (%s): the readers will check it", type(exc).__name__)
            return (TOKENS,)
        raise SpecError("data.source", f"{data.source} cannot be read: {_reason(exc)}") from None
    index = _check_index(data, seq_len, vocab_size) if is_dir else None  # a prepared corpus has an index.json
    columns: tuple[str, ...] | None = None
    for path in _spread(files, MAX_FOOTERS):
        have = _check_footer(fs, path, seq_len, vocab_size)
        if columns is not None and have != columns:
            raise SpecError("data.source", f"{redact_uri(path)} has the columns {have}; the first file has {columns}")
        columns = have
    if index is not None:
        _check_sidecars(fs, index, data.source)
    _check_sample(fs, files[0], seq_len, vocab_size, columns or (TOKENS,))
    return columns or (TOKENS,)


def check_rows(rows: Any, row_width: int, vocab_size: int, where: str) -> None:
    """Rows about to be trained on: ``row_width`` ids each, every id below ``vocab_size``
    (``CorpusError`` otherwise: a retry would read the same rows)."""
    if rows.ndim != 2 or rows.shape[1] != row_width:
        width = rows.shape[1] if rows.ndim == 2 else "ragged"
        raise CorpusError(f"{where}: rows of {width} ids; model.seq_len + 1 = {row_width} expected")
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= vocab_size):
        raise CorpusError(
            f"{where}: token ids from {int(rows.min())} to {int(rows.max())}; model.vocab_size {vocab_size} "
            f"allows 0..{vocab_size - 1}"
        )


# --------------------------------------------------------------------------- the checks


def _parquet_files(source: str, options: dict[str, Any]) -> tuple[Any, list[str], bool]:
    """The source's filesystem, its parquet files in order, and whether it is a directory."""
    fs, root = url_to_fs(source, options)
    if fs.isdir(root):
        files = corpus_files(fs, root)
        if not files:
            raise SpecError("data.source", f"{redact_uri(source)} holds no .parquet files")
        return fs, files, True
    return fs, [root], False


def _check_index(data: Any, seq_len: int, vocab_size: int) -> CorpusIndex | None:
    try:
        index = read_index(data.source, data.storage_options)
    except Exception as exc:  # noqa: BLE001 - a damaged index: the shards are checked below anyway
        raise SpecError("data.source", f"{redact_uri(data.source)}/index.json is unreadable: {_reason(exc)}") from None
    if index is None:
        return None
    if index.seq_len != seq_len:
        raise SpecError(
            "data.source",
            f"{redact_uri(data.source)} was prepared with --seq-len {index.seq_len} (rows of {index.seq_len + 1} "
            f"ids); set model.seq_len={index.seq_len}, or prepare it again with --seq-len {seq_len}",
        )
    vocab = int(index.tokenizer.get("vocab_size", 0))
    if vocab > vocab_size:
        raise SpecError(
            "data.source",
            f"{redact_uri(data.source)} was tokenized with a vocabulary of {vocab}; model.vocab_size is {vocab_size}",
        )
    return index


def _check_sidecars(fs: Any, index: CorpusIndex, source: str) -> None:
    """A version 3 corpus's row-group sidecars (the first, the last and evenly spaced ones)
    are there, of the size the index says: the host readers read every group's metadata
    from them (one size query each)."""
    shards = _spread([s for s in index.shards if s.sidecar], MAX_FOOTERS)
    for shard in shards:
        name = f"{redact_uri(source).rstrip('/')}/{shard.groups_path}"
        try:
            size = int(fs.size(fsspec.core.strip_protocol(index.sidecar_uri(shard))))
        except Exception as exc:  # noqa: BLE001 - missing or unreadable
            raise SpecError("data.source", f"{name} (the row-group sidecar of {shard.path}): {_reason(exc)}") from None
        if size != shard.groups_bytes:
            raise SpecError("data.source", f"{name}: {size} bytes; its index.json says {shard.groups_bytes}")


def _check_footer(fs: Any, path: str, seq_len: int, vocab_size: int) -> tuple[str, ...]:
    name = redact_uri(path)
    try:
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except Exception as exc:  # noqa: BLE001 - corrupt, empty, truncated or unreadable
        raise SpecError("data.source", f"{name} is not a readable parquet file: {_reason(exc)}") from None
    if TOKENS not in schema.names:
        raise SpecError("data.source", f"{name} has no '{TOKENS}' column (columns: {', '.join(schema.names)})")
    kind = schema.field(TOKENS).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        raise SpecError("data.source", f"{name}: column '{TOKENS}' is {kind}, not a list of token ids")
    if not pa.types.is_integer(kind.value_type):
        raise SpecError("data.source", f"{name}: column '{TOKENS}' holds {kind.value_type}, not integer token ids")
    width = seq_len + 1
    if pa.types.is_fixed_size_list(kind) and kind.list_size != width:
        raise SpecError("data.source", f"{name}: rows of {kind.list_size} ids; model.seq_len + 1 = {width} expected")
    if meta.num_rows == 0:
        raise SpecError("data.source", f"{name} holds no rows")
    columns = (TOKENS, *(c for c in SFT_COLUMNS if c in schema.names))
    for c in columns[1:]:
        _check_sft_column(meta, schema, c, name, width)
    column = _leaf_column(meta)
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(column)
        rows = meta.row_group(g).num_rows
        if not pa.types.is_fixed_size_list(kind) and chunk.num_values != rows * width:
            raise SpecError(
                "data.source",
                f"{name}: row group {g} holds {chunk.num_values} ids in {rows} rows; every row needs "
                f"model.seq_len + 1 = {width}",
            )
        stats = chunk.statistics
        if stats is not None and stats.has_min_max and (stats.min < 0 or stats.max >= vocab_size):
            raise SpecError(
                "data.source",
                f"{name}: token ids from {stats.min} to {stats.max} in row group {g}; model.vocab_size "
                f"{vocab_size} allows 0..{vocab_size - 1}",
            )
    return columns


def _check_sft_column(meta: Any, schema: Any, column: str, name: str, width: int) -> None:
    """A ``loss_mask`` or ``document_ids`` column: lists of integers (``loss_mask`` may be
    booleans), ``width`` long in every row."""
    kind = schema.field(column).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        raise SpecError("data.source", f"{name}: column '{column}' is {kind}, not a list per row")
    ok = pa.types.is_integer(kind.value_type) or (column == LOSS_MASK and pa.types.is_boolean(kind.value_type))
    if not ok:
        raise SpecError("data.source", f"{name}: column '{column}' holds {kind.value_type}, not integers")
    if pa.types.is_fixed_size_list(kind):
        if kind.list_size != width:
            raise SpecError(
                "data.source", f"{name}: column '{column}' has rows of {kind.list_size}; model.seq_len + 1 = {width}"
            )
        return
    leaf = _leaf_column(meta, column)
    for g in range(meta.num_row_groups):
        rows, values = meta.row_group(g).num_rows, meta.row_group(g).column(leaf).num_values
        if values != rows * width:
            raise SpecError(
                "data.source",
                f"{name}: column '{column}' holds {values} values in {rows} rows of row group {g}; every row needs "
                f"model.seq_len + 1 = {width}",
            )


def _check_sample(fs: Any, path: str, seq_len: int, vocab_size: int, columns: tuple[str, ...] = (TOKENS,)) -> None:
    import numpy as np

    name = redact_uri(path)
    try:
        with fs.open(path, "rb") as f:
            batch = next(pq.ParquetFile(f).iter_batches(batch_size=SAMPLE_ROWS, columns=list(columns)))
            col = batch.column(0)
            rows = [np.asarray(r if r is not None else [], dtype=np.int64) for r in col.to_pylist()]
            extra = {c: batch.column(i + 1).to_pylist() for i, c in enumerate(columns[1:])}
    except Exception as exc:  # noqa: BLE001
        raise SpecError("data.source", f"{name}: its first rows cannot be read: {_reason(exc)}") from None
    for c, values in extra.items():
        lengths = {len(v) if v is not None else 0 for v in values}
        if lengths != {seq_len + 1}:
            bad = sorted(lengths - {seq_len + 1})[0]
            raise SpecError("data.source", f"{name}: column '{c}' has rows of {bad}; model.seq_len + 1 = {seq_len + 1}")
        if c == LOSS_MASK and not {int(x) for v in values for x in v} <= {0, 1}:
            raise SpecError("data.source", f"{name}: column '{LOSS_MASK}' holds values other than 0 and 1")
    widths = {len(r) for r in rows}
    if widths != {seq_len + 1}:
        bad = sorted(widths - {seq_len + 1})[0]
        raise SpecError("data.source", f"{name}: rows of {bad} ids; model.seq_len + 1 = {seq_len + 1} expected")
    try:
        check_rows(np.stack(rows), seq_len + 1, vocab_size, name)
    except CorpusError as exc:
        raise SpecError("data.source", str(exc)) from None


def _leaf_column(meta: Any, column: str = TOKENS) -> int:
    for i in range(meta.num_columns):
        if meta.schema.column(i).path.split(".")[0] == column:
            return i
    raise AssertionError(f"no leaf column of {column}")  # the arrow schema named it


def _spread(files: list[T], most: int) -> list[T]:
    """At most ``most`` of ``files``: all of them, or the first, the last and evenly spaced ones."""
    if len(files) <= most:
        return files
    step = (len(files) - 1) / (most - 1)
    return [files[round(i * step)] for i in range(most)]


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
