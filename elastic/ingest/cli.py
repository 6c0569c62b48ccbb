"""The ``elastic prepare`` subcommand: ``add_arguments(parser)`` and ``main(args) -> int``."""

from __future__ import annotations

import argparse
import sys

from elastic.ingest.prepare import FORMATS, ROWS_PER_GROUP
from elastic.ingest.row_packing import OVERLONG


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="input file or directory: a path, file://... or s3://...")
    parser.add_argument("output", help="where the corpus goes (a directory: path, file://... or s3://...)")
    parser.add_argument(
        "--format",
        choices=(*FORMATS, "chat"),
        default=None,
        help="default: from the file names; chat: JSON lines of {'messages': [...]} through --tokenizer DIR's chat "
        "template, packed into rows with loss_mask (assistant tokens) and document_ids (docs/data.md)",
    )
    parser.add_argument("--text-field", default="text", help="the field holding the text (jsonl, parquet)")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="byte, bpe:VOCAB_SIZE or PATH/tokenizer.json; with --format chat a Hugging Face tokenizer directory",
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample; rows hold seq_len + 1 ids")
    parser.add_argument("--rows-per-shard", type=int, default=2048, help="rows per parquet shard")
    parser.add_argument(
        "--rows-per-group",
        type=int,
        default=ROWS_PER_GROUP,
        help="rows per parquet row group, the unit a host reader fetches: at most a replica's share of a "
        f"batch (global_batch / dp) for reads of about what it consumes (default {ROWS_PER_GROUP}; docs/data.md)",
    )
    parser.add_argument(
        "--overlong",
        choices=OVERLONG,
        default="refuse",
        help="--format chat: a conversation longer than a row is refused (exit 2), truncated to one row, or split "
        "across rows as separate documents (default refuse)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join: HOST:PORT, or auto for the one running on this machine "
        "(default: RAY_ADDRESS, else an embedded cluster for this command alone)",
    )


def main(args: argparse.Namespace) -> int:
    from elastic.errors import SpecError
    from elastic.ingest.prepare import PrepareConfig, check_input, prepare

    cfg = PrepareConfig(
        input=args.input,
        output=args.output,
        format=args.format,
        text_field=args.text_field,
        tokenizer=args.tokenizer,
        seq_len=args.seq_len,
        rows_per_shard=args.rows_per_shard,
        rows_per_group=args.rows_per_group,
        overlong=args.overlong,
    )
    if args.format == "chat":
        return _main_chat(cfg)
    try:
        check_input(cfg)  # bad input is reported before Ray starts
        started = _connect(args.address)
        try:
            result = prepare(cfg)
        finally:
            if started:
                import ray

                ray.shutdown()
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    idx = result.index
    print(
        f"prepared {result.docs:,} documents -> {result.rows:,} rows of {idx.seq_len + 1} tokens "
        f"({result.tokens:,} tokens) in {result.shards} shards, tokenizer {idx.tokenizer['kind']} "
        f"(vocab {idx.tokenizer['vocab_size']}), {result.wall_s:.1f}s, {result.tokens_per_s:,.0f} tokens/s"
    )
    print(
        f"use it with: --set data.source={cfg.output} --set model.seq_len={idx.seq_len} "
        f"--set model.vocab_size={idx.tokenizer['vocab_size']}"
    )
    return 0


def _main_chat(cfg) -> int:
    """``--format chat``: in this process, no Ray (elastic/ingest/prepare_chat.py)."""
    from elastic.errors import SpecError
    from elastic.ingest.prepare_chat import prepare_chat

    try:
        result = prepare_chat(cfg)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s, width = result.stats, result.width
    print(
        f"prepared {s.documents:,} conversations -> {s.rows:,} rows of {width} tokens in {result.shards} shards, "
        f"tokenizer {cfg.tokenizer} (vocab {result.index.tokenizer['vocab_size']}), {result.wall_s:.1f}s"
    )
    print(
        f"rows {s.fill(width):.1%} full ({s.tokens:,} of {s.rows * width:,} tokens are not padding), "
        f"{s.counted_fraction(width):.1%} of targets counted in the loss ({s.counted:,} assistant tokens)"
    )
    if s.truncated:
        print(f"truncated {s.truncated:,} conversations longer than a row ({s.dropped_tokens:,} tokens dropped)")
    if s.split:
        print(f"split {s.split:,} conversations longer than a row into several rows")
    print(
        f"use it with: --set data.source={cfg.output} --set model.seq_len={cfg.seq_len} "
        f"--set model.vocab_size={result.index.tokenizer['vocab_size']}"
    )
    return 0


def _connect(address: str | None) -> bool:
    """Join ``--address`` (or ``RAY_ADDRESS``; ``auto``: the cluster running here), else start an
    embedded Ray on this machine's CPUs (``elastic/ray_join.py``). True when started here."""
    import os

    import ray

    from elastic import ray_join

    if ray.is_initialized():
        return False
    return ray_join.connect(ray_join.resolve(address), ray_join.embedded(os.cpu_count() or 1))
