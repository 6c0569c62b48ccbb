"""Prepared corpora for the data-ingest tests, written locally without Ray: the shards,
sidecars and index that ``elastic prepare`` writes for given rows (``write_corpus``), and a
prepared corpus's twin under an older index (``as_version``: what an older ``elastic prepare``
wrote for the same shards). Runs in the test process."""

from __future__ import annotations

import os
import shutil

import numpy as np

from elastic.ingest.index import CorpusIndex, read_index, write_index
from elastic.ingest.sidecar import shard_entry


def write_corpus(
    root: str, rows: np.ndarray, rows_per_shard: int, rows_per_group: int, version: int = 3, vocab_size: int = 300
) -> CorpusIndex:
    """``rows`` (``[n, seq_len + 1]`` ids below ``vocab_size``) as a corpus under ``root`` with
    an index of ``version`` (the sidecars written only for version 3)."""
    os.makedirs(root, exist_ok=True)
    shards = []
    for i, start in enumerate(range(0, len(rows), rows_per_shard)):
        data, side, shard = shard_entry(f"part-{i:05d}.parquet", rows[start : start + rows_per_shard], rows_per_group)
        with open(os.path.join(root, shard.path), "wb") as f:
            f.write(data)
        if version == 3:
            with open(os.path.join(root, str(shard.groups_path)), "wb") as f:
                f.write(side)
        shards.append(shard)
    index = CorpusIndex(root, rows.shape[1] - 1, {"vocab_size": vocab_size}, tuple(shards)).as_version(version)
    write_index(root, index)
    return index


def as_version(src: str, dst: str, version: int) -> str:
    """A copy of the prepared corpus ``src`` at ``dst`` under an index of ``version`` (its
    sidecars left out below version 3: the older reads must not need them)."""
    index = read_index(src)
    if index is None:
        raise FileNotFoundError(f"{src} has no index.json")
    shutil.copytree(src, dst, ignore=None if version == 3 else shutil.ignore_patterns("*.groups"))
    write_index(dst, index.as_version(version))
    return dst
