"""SFT packing: counted tokens per second with conversations packed into rows (document masks)
against one conversation padded to each row, the same model and the same conversations, in
one run.

The conversations are made here (nothing downloaded), with lengths from published figures:
each has a number of user/assistant turns drawn from a geometric distribution of mean 2.34
(Open Assistant's average turns), and each message a log-normal number of tokens fitted by
moments to Alpaca's user 19.67 +/- 15.19 and assistant 64.51 +/- 64.85 tokens per message
(both from Table 1 of "ShareChat: A Dataset of Chatbot Conversations in the Wild", Yan et
al., arXiv:2512.17843). The tokenizer is the byte-level ChatML one of
``elastic.testing.chat_data`` (one token per character of content), so the template adds
about 5 tokens a message. Conversations longer than a row are truncated on both sides
(``--overlong truncate``): both train the same tokens.

Both corpora come from ``elastic prepare --format chat`` (``prepare_chat``): packed (first
fit, ``document_ids``: block-diagonal causal attention) and one conversation a row
(``pack=False``: no ``document_ids``, plain causal attention, the rest of the row padding).
One spawned rank (a world-size-1 gloo group) trains a tiny Llama with the engine on each in
turn, ``--steps`` measured steps after ``--warmup`` per side and repetition, alternating
which side goes first so that drift in a shared machine's load falls on both alike. A
side's figure is its **counted tokens per second**: the non-padding tokens of the rows it
trained over the wall time of those steps (the data read included: a prefetching reader);
the loss-counted (assistant) targets per second are reported beside it, and the counted
tokens per CPU second of the rank's process (all its threads: on a machine shared with other
work, wall time moves with the neighbours' load while CPU time barely does). The ratio
packed / padded of counted tokens/s is the goal's (>= 1.5x); its median and range over
``--reps`` repetitions, with the machine's load, are printed and written with ``--json``.

Usage::

    .venv/bin/python -m benchmarks.sft_packing [--conversations 1200] [--seq-len 512] [--reps 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.harness.results import machine, utc_stamp, write_json

TURNS_MEAN = 2.34  # Open Assistant (ShareChat, Table 1)
USER_TOKENS = (19.67, 15.19)  # Alpaca, per user message: mean, std (ShareChat, Table 1)
ASSISTANT_TOKENS = (64.51, 64.85)  # Alpaca, per assistant message


def lognormal(rng: np.random.Generator, mean: float, std: float, n: int) -> np.ndarray:
    """``n`` draws of a log-normal with this mean and standard deviation (moment fit), at least 1."""
    sigma2 = math.log(1 + (std / mean) ** 2)
    return np.maximum(1, np.rint(rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), n))).astype(int)


def conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    from elastic.testing.chat_data import conversation

    rng = np.random.default_rng(seed)
    turns = rng.geometric(1 / TURNS_MEAN, n)
    out = []
    for t in turns:
        lengths = np.empty(2 * t, dtype=int)
        lengths[0::2] = lognormal(rng, *USER_TOKENS, t)
        lengths[1::2] = lognormal(rng, *ASSISTANT_TOKENS, t)
        out.append(conversation(rng, int(t), lengths.tolist()))
    return out


def prepare(records: list[dict], work: str, seq_len: int, pack: bool) -> tuple[str, Any]:
    from elastic.ingest.prepare import PrepareConfig
    from elastic.ingest.prepare_chat import prepare_chat
    from elastic.testing.chat_data import save_chat_tokenizer, write_chat_jsonl

    tok = os.path.join(work, "tok")
    if not os.path.isdir(tok):
        save_chat_tokenizer(tok)
    src = os.path.join(work, "chat.jsonl")
    if not os.path.exists(src):
        write_chat_jsonl(src, records)
    out = os.path.join(work, "packed" if pack else "padded")
    cfg = PrepareConfig(
        src, out, format="chat", tokenizer=tok, seq_len=seq_len, overlong="truncate", pack=pack, rows_per_shard=4096
    )
    return out, prepare_chat(cfg)


def row_counts(uri: str) -> tuple[np.ndarray, np.ndarray]:
    """Per row: its non-padding tokens and its targets counted in the loss."""
    import pyarrow.parquet as pq

    from elastic.ingest.index import read_index
    from elastic.ingest.sft_rows import IGNORE, SftRows

    index = read_index(uri)
    tables = [pq.read_table(index.uri(s)) for s in index.shards]
    cols = {c: np.concatenate([np.asarray(t.column(c).to_pylist()) for t in tables]) for c in index.columns}
    docs = cols.get("document_ids")
    if docs is not None:
        real = (docs != -1).sum(axis=1)
    else:  # one conversation a row: its tokens end where the trailing padding begins
        pad = int(index.tokenizer["pad_id"])
        t = cols["tokens"]
        nonpad = t != pad
        real = np.where(nonpad.any(axis=1), t.shape[1] - np.argmax(nonpad[:, ::-1], axis=1), 0)
    counted = (SftRows(cols["tokens"], cols["loss_mask"], docs).targets() != IGNORE).sum(axis=1)
    return real, counted


def train_sides(rank: int, world: int, out_dir: str, cfg: dict) -> dict[str, list[dict[str, float]]]:
    """In the spawned rank: ``reps`` x both sides, alternating which goes first; each a fresh
    stream from batch 0, ``warmup`` steps then ``steps`` timed ones."""
    import torch

    from elastic.engine import TrainEngine
    from elastic.ingest.corpus import BatchLayout, RankStream
    from elastic.ingest.parquet_corpus import ParquetCorpus
    from elastic.models.config import LlamaConfig
    from elastic.optim import TrainConfig
    from elastic.parallel.config import ParallelConfig
    from elastic.parallel.dims import ParallelDims
    from elastic.testing.ranks import init_group

    torch.set_num_threads(cfg["threads"])
    torch.set_flush_denormal(True)  # tiny weights late in a run would otherwise slow one side's steps
    init_group(rank, world, os.path.join(out_dir, "store"))
    model = LlamaConfig(**cfg["model"])
    train = TrainConfig(steps=1000, global_batch=cfg["global_batch"], lr=1e-3, warmup_steps=0, schedule="constant")
    dims = ParallelDims(dp=1, tp=1, pp=1, world_size=1)
    engine = TrainEngine(model, ParallelConfig(micro_batch=cfg["micro_batch"]), train, dims, seed=0)
    layout = BatchLayout(cfg["global_batch"], cfg["micro_batch"], 1)
    out: dict[str, list[dict[str, float]]] = {"packed": [], "padded": []}
    for rep in range(cfg["reps"]):
        order = ("padded", "packed") if rep % 2 == 0 else ("packed", "padded")
        for side in order:
            real, counted = (np.asarray(x) for x in cfg["counts"][side])
            corpus = ParquetCorpus(cfg["uris"][side])
            stream = RankStream(corpus, layout, 0, start_batch=0, prefetch=2)
            tokens = targets = 0
            try:
                for i in range(cfg["warmup"] + cfg["steps"]):
                    if i == cfg["warmup"]:
                        t0, c0 = time.perf_counter(), time.process_time()
                    b, micro = stream.next(timeout=120)
                    engine.forward_backward(micro)
                    engine.optimizer_step()
                    if i >= cfg["warmup"]:
                        rows = layout.rank_samples(b, 0) % corpus.num_rows
                        tokens += int(real[rows].sum())
                        targets += int(counted[rows].sum())
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            finally:
                stream.close()
            out[side].append({"tokens_per_s": tokens / wall, "targets_per_s": targets / wall, "wall_s": wall,
                              "tokens_per_cpu_s": tokens / cpu, "cpu_s": cpu})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=1200)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the training rank (1: no spinning thread on a loaded host)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from elastic.testing.chat_data import VOCAB
    from elastic.testing.ranks import run_ranks

    load_before = os.getloadavg()
    records = conversations(args.conversations)
    work = tempfile.mkdtemp(prefix="sft-packing-")
    sides: dict[str, Any] = {}
    for side, pack in (("packed", True), ("padded", False)):
        uri, res = prepare(records, work, args.seq_len, pack)
        real, counted = row_counts(uri)
        width = args.seq_len + 1
        assert int(real.sum()) == res.stats.tokens and int(counted.sum()) == res.stats.counted, side
        sides[side] = {"uri": uri, "rows": res.stats.rows, "fill": res.stats.fill(width),
                       "counted_fraction": res.stats.counted_fraction(width), "truncated": res.stats.truncated,
                       "counts": (real.tolist(), counted.tolist())}  # fmt: skip
    lengths = [sides["packed"]["rows"], sides["padded"]["rows"]]
    print(
        f"{args.conversations} conversations, rows of {args.seq_len + 1}: packed into {lengths[0]} rows "
        f"({sides['packed']['fill']:.1%} full), one a row {lengths[1]} rows ({sides['padded']['fill']:.1%} full); "
        f"{sides['packed']['truncated']} truncated"
    )
    heads = max(1, args.d_model // 32)
    cfg = {
        "model": {"n_layers": args.layers, "d_model": args.d_model, "n_heads": heads, "n_kv_heads": heads,
                  "vocab_size": VOCAB, "seq_len": args.seq_len, "multiple_of": 16},
        "global_batch": args.global_batch, "micro_batch": args.micro_batch, "steps": args.steps,
        "warmup": args.warmup, "reps": args.reps, "threads": args.threads,
        "uris": {k: v["uri"] for k, v in sides.items()}, "counts": {k: v["counts"] for k, v in sides.items()},
    }  # fmt: skip
    from benchmarks.sft_packing import train_sides as rank_fn  # by its module name: the spawned rank imports it

    (got,) = run_ranks(1, rank_fn, (cfg,), os.path.join(work, "rank"))
    ratios = [p["tokens_per_s"] / q["tokens_per_s"] for p, q in zip(got["packed"], got["padded"])]
    target_ratios = [p["targets_per_s"] / q["targets_per_s"] for p, q in zip(got["packed"], got["padded"])]
    cpu_ratios = [p["tokens_per_cpu_s"] / q["tokens_per_cpu_s"] for p, q in zip(got["packed"], got["padded"])]
    med = statistics.median(ratios)
    for side in ("packed", "padded"):
        tps = [r["tokens_per_s"] for r in got[side]]
        print(
            f"{side:>6}: {statistics.median(tps):,.0f} counted tokens/s (range {min(tps):,.0f}..{max(tps):,.0f}), "
            f"{statistics.median(r['targets_per_s'] for r in got[side]):,.0f} loss targets/s"
        )
    print(
        f"packed / padded = {med:.2f}x counted tokens/s (range {min(ratios):.2f}..{max(ratios):.2f}, "
        f"{args.reps} reps; goal >= 1.5x), {statistics.median(target_ratios):.2f}x loss targets/s, "
        f"{statistics.median(cpu_ratios):.2f}x counted tokens per CPU second "
        f"(range {min(cpu_ratios):.2f}..{max(cpu_ratios):.2f}); "
        f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs"
    )
    if args.json:
        result = {
            "benchmark": "sft_packing",
            "distribution": {
                "turns": f"geometric, mean {TURNS_MEAN} (Open Assistant)",
                "user_tokens": f"log-normal, mean {USER_TOKENS[0]} std {USER_TOKENS[1]} (Alpaca)",
                "assistant_tokens": f"log-normal, mean {ASSISTANT_TOKENS[0]} std {ASSISTANT_TOKENS[1]} (Alpaca)",
                "source": "ShareChat (Yan et al., arXiv:2512.17843), Table 1",
                "template": "ChatML, byte-level tokenizer (elastic.testing.chat_data)",
            },
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "sides": {
                k: {f: v[f] for f in ("rows", "fill", "counted_fraction", "truncated")} | {"runs": got[k]}
                for k, v in sides.items()
            },  # fmt: skip
            "ratio_tokens_per_s": ratios,
            "ratio_median": med,
            "ratio_targets_per_s": target_ratios,
            "ratio_tokens_per_cpu_s": cpu_ratios,
            "goal": ">= 1.5",
            "loadavg_before": list(load_before),
            "date_utc": utc_stamp(),
            "machine": machine(),
        }
        write_json(args.json, result, newline=False)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
