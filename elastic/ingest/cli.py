"""The ``elastic prepare`` subcommand: ``add_arguments(parser)`` and ``main(args) -> int``."""

from __future__ import annotations

import argparse
import logging
import sys

from elastic.ingest.prepare import FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="input file or directory: a path, file://... or s3://...")
    parser.add_argument("output", help="where the corpus goes (a directory: path, file://... or s3://...)")
    parser.add_argument("--format", choices=FORMATS, default=None, help="default: from the file names")
    parser.add_argument("--text-field", default="text", help="the field holding the text (jsonl, parquet)")
    parser.add_argument("--tokenizer", default="byte", help="byte, bpe:VOCAB_SIZE or PATH/tokenizer.json")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample; rows hold seq_len + 1 ids")
    parser.add_argument("--rows-per-shard", type=int, default=2048, help="rows per parquet shard")
    parser.add_argument(
        "--address", default=None, help="Ray cluster address (default: join a running one, else embedded)"
    )


def main(args: argparse.Namespace) -> int:
    from elastic.errors import SpecError
    from elastic.ingest.prepare import PrepareConfig, prepare

    cfg = PrepareConfig(
        input=args.input,
        output=args.output,
        format=args.format,
        text_field=args.text_field,
        tokenizer=args.tokenizer,
        seq_len=args.seq_len,
        rows_per_shard=args.rows_per_shard,
    )
    try:
        from elastic.ingest import tokenizer as toks

        toks.parse_tokenizer(cfg.tokenizer)  # bad input is reported before Ray starts
        if cfg.seq_len < 1:
            raise SpecError("--seq-len", f"must be >= 1, got {cfg.seq_len}")
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


def _connect(address: str | None) -> bool:
    import os

    import ray

    from elastic.api import running_cluster_address

    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    target = address or running_cluster_address()
    if target:
        ray.init(address=target, **quiet)
        return False
    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, **quiet)
    return True
