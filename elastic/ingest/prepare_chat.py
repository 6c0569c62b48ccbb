"""``elastic prepare INPUT OUTPUT --format chat --tokenizer DIR``: chat JSON lines to packed SFT rows.

Each input line is ``{"messages": [{"role": ..., "content": ...}, ...]}``. The conversation goes
through the tokenizer's own chat template (``elastic.ingest.chat_template``: its ids, and 1 on
the assistant's tokens); the conversations are packed whole into rows of ``seq_len + 1``
(``elastic.ingest.row_packing``: first fit, ``--overlong`` for one longer than a row) with
``loss_mask`` (the assistant's tokens) and ``document_ids`` (attention never crosses a
conversation; positions restart at each). The corpus has the layout of ``elastic prepare``'s:
parquet shards of ``rows_per_shard`` rows in row groups of ``rows_per_group``, written with its
settings (page checksums, zstd, no dictionary) and three fixed-size list columns, then
``tokenizer.json`` and, last, ``index.json`` (``columns`` names the three; the index's shard
entries are version 2: the host readers read ``tokens`` alone, so the rank's own reader
reads this corpus, which ``data.loader: auto`` picks). Every row is kept: the last is padded.
``PrepareConfig.pack = False`` writes one conversation a row instead, without ``document_ids``
(a row's padding follows its one document, which causal attention never lets it see): the
baseline of ``benchmarks/sft_packing.py``.

It runs in this process, without Ray: rendering a template is Python (Jinja), several hundred
conversations a second. Bad input is a ``SpecError`` naming ``INPUT``, ``messages``,
``--tokenizer`` or ``--seq-len``, with the file and line; nothing is left in ``OUTPUT`` then.
See docs/data.md, "Chat data".
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from elastic.errors import SpecError
from elastic.ingest.chat_template import ChatTemplate
from elastic.ingest.index import CorpusIndex, Shard, sha256, write_index
from elastic.ingest.parquet_corpus import DOCUMENT_IDS, LOSS_MASK, TOKENS
from elastic.ingest.row_packing import PackStats, RowPacker
from elastic.ingest.shard_format import encode_table, footer_span
from storage import open_storage, redact_uri

CHAT_COLUMNS = (TOKENS, LOSS_MASK, DOCUMENT_IDS)


@dataclass
class ChatPrepareResult:
    stats: PackStats
    shards: int
    wall_s: float
    index: CorpusIndex

    @property
    def width(self) -> int:
        return self.index.seq_len + 1


def encode_chat_shard(tokens: np.ndarray, mask: np.ndarray, docs: np.ndarray | None, rows_per_group: int) -> bytes:
    """The ``[n, width]`` columns as one parquet shard, with ``elastic prepare``'s writer settings
    (``docs`` None: no ``document_ids`` column, one document a row)."""
    width = tokens.shape[1]

    def col(a: np.ndarray, t: pa.DataType) -> pa.FixedSizeListArray:
        return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(a).reshape(-1), type=t), width)

    cols = {TOKENS: col(tokens, pa.int32()), LOSS_MASK: col(mask, pa.int8())}
    if docs is not None:
        cols[DOCUMENT_IDS] = col(docs, pa.int32())
    return encode_table(pa.table(cols), rows_per_group)


def conversations(cfg: Any, fs: Any, files: list[str]):
    """``(messages, where)`` for every line of the input, in order; ``SpecError`` on a bad one."""
    for path in files:
        name = redact_uri(path)
        with fs.open(path, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                where = f"{name} line {n}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise SpecError("INPUT", f"{where} is not valid UTF-8 (byte {exc.start})") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise SpecError("INPUT", f"{where} is not JSON") from None
                yield check_messages(record, where), where


def check_messages(record: Any, where: str) -> list[dict[str, Any]]:
    """A record's ``messages``: a non-empty list of objects with a string ``role`` and ``content``."""
    if not isinstance(record, dict) or "messages" not in record:
        raise SpecError("messages", f"{where} is not an object with 'messages'")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise SpecError("messages", f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SpecError("messages", f"{where}: message {i} must be an object with a string 'role' and 'content'")
    return messages


def check_chat_input(cfg: Any) -> tuple[Any, list[str], ChatTemplate]:
    """What can be checked before reading the input: the options and the tokenizer."""
    from elastic.ingest.prepare import list_inputs

    if cfg.seq_len < 1:
        raise SpecError("--seq-len", f"must be >= 1, got {cfg.seq_len}")
    if cfg.rows_per_shard < 1:
        raise SpecError("--rows-per-shard", f"must be >= 1, got {cfg.rows_per_shard}")
    if not 1 <= cfg.rows_per_group <= cfg.rows_per_shard:
        raise SpecError(
            "--rows-per-group", f"must be from 1 to --rows-per-shard ({cfg.rows_per_shard}), got {cfg.rows_per_group}"
        )
    template = ChatTemplate(cfg.tokenizer)
    fs, files = list_inputs(cfg.input, cfg.storage_options)
    return fs, files, template


def pad_id(template: ChatTemplate) -> int:
    tok = template.tok
    for i in (tok.pad_token_id, tok.eos_token_id):
        if i is not None:
            return int(i)
    return 0  # padding is never attended to from a document nor counted: any id will do


def prepare_chat(cfg: Any) -> ChatPrepareResult:
    """The whole pipeline (module docstring). Nothing is left in ``cfg.output`` when it fails."""
    out = open_storage(cfg.output, cfg.storage_options)
    written: list[str] = []
    try:
        return _prepare_chat(cfg, out, written)
    except BaseException:
        for uri in written:
            out.rm(uri)
        raise


def _prepare_chat(cfg: Any, out: Any, written: list[str]) -> ChatPrepareResult:
    t0 = time.perf_counter()
    fs, files, template = check_chat_input(cfg)
    width = cfg.seq_len + 1
    pack = cfg.pack
    shards: list[Shard] = []
    pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def put(name: str, data: bytes) -> None:
        uri = out.join(cfg.output, name)
        written.append(uri)
        out.put_bytes(uri, data)

    def flush() -> None:
        tokens, mask, docs = (np.stack(c) for c in zip(*pending))
        data = encode_chat_shard(tokens, mask, docs if pack else None, cfg.rows_per_group)
        offset, length = footer_span(data)
        name = f"part-{len(shards):05d}.parquet"
        put(name, data)
        shards.append(
            Shard(
                path=name,
                rows=len(pending),
                bytes=len(data),
                sha256=sha256(data),
                footer_offset=offset,
                footer_bytes=length,
                footer_sha256=sha256(data[offset:]),
                rows_per_group=cfg.rows_per_group,
            )
        )
        pending.clear()

    def emit(tokens: np.ndarray, mask: np.ndarray, docs: np.ndarray) -> None:
        pending.append((tokens, mask, docs))
        if len(pending) == cfg.rows_per_shard:
            flush()

    packer = RowPacker(width, pad_id(template), emit, overlong=cfg.overlong, pack=pack)
    for messages, where in conversations(cfg, fs, files):
        chat = template.render(messages, where)
        packer.add(chat.ids, chat.assistant, where)
    packer.finish()
    if pending:
        flush()
    if packer.stats.documents == 0:
        raise SpecError("INPUT", f"{redact_uri(cfg.input)} holds no conversations")
    backend = template.tok.backend_tokenizer.to_str()
    put("tokenizer.json", backend.encode())
    described = {
        "kind": "chat",
        "vocab_size": template.vocab_size,
        "eot_id": template.tok.eos_token_id,
        "pad_id": pad_id(template),
        "sha256": sha256(backend.encode()),
        "chat_template_sha256": hashlib.sha256(template.template.encode()).hexdigest(),
    }
    index = CorpusIndex(
        root=cfg.output,
        seq_len=cfg.seq_len,
        tokenizer=described,
        shards=tuple(shards),
        columns=CHAT_COLUMNS if pack else CHAT_COLUMNS[:2],
    )
    write_index(cfg.output, index, cfg.storage_options)  # last: the corpus is complete from here on
    return ChatPrepareResult(packer.stats, len(shards), time.perf_counter() - t0, index)
