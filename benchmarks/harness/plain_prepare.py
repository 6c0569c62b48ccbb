"""The baseline of ``elastic prepare`` in ``data_ingest`` and ``prepare_throughput``: one
process reads the text, tokenizes it 64 documents at a time (``encode_batch``, the same
tokenizer), packs the rows with the same packing code and writes the same parquet shards.
Runs in the benchmark's driver process.
"""

from __future__ import annotations

import os
import time

import numpy as np


def plain_loop(text_dir, tokenizer_path, out_dir, seq_len, rows_per_shard) -> float:
    """The baseline: one process reads, tokenizes (encode_batch), packs and writes; returns tokens/s."""
    from elastic.ingest import tokenizer as toks
    from elastic.ingest.prepare import ROWS_PER_GROUP, _Packer, iter_texts
    from elastic.ingest.shard_format import encode_shard

    t0 = time.perf_counter()
    tok = toks.byte_tokenizer() if tokenizer_path == "byte" else toks.load_file(tokenizer_path)
    eot = toks.eot_id(tok)
    os.makedirs(out_dir, exist_ok=True)
    n = [0]

    def write(rows):
        with open(os.path.join(out_dir, f"part-{n[0]:05d}.parquet"), "wb") as f:
            f.write(encode_shard(rows, ROWS_PER_GROUP))
        n[0] += 1

    packer = _Packer(seq_len + 1, rows_per_shard, write)
    batch = []
    for text in iter_texts(text_dir):
        batch.append(text)
        if len(batch) == 64:
            for e in tok.encode_batch(batch, add_special_tokens=False):
                packer.add(np.append(np.asarray(e.ids, dtype=np.int32), np.int32(eot)))
            batch = []
    for e in tok.encode_batch(batch, add_special_tokens=False):
        packer.add(np.append(np.asarray(e.ids, dtype=np.int32), np.int32(eot)))
    packer.finish(ROWS_PER_GROUP)
    return packer.rows * (seq_len + 1) / (time.perf_counter() - t0)
