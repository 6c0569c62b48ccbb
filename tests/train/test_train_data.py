"""The exact data split (elastic/train/data.py): every row once per epoch, whatever the
group's size does between batches; no cluster."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from elastic.train.data import ExactLoader, Position, global_order, rank_slice


class Rows(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _epoch(n: int, worlds: list[int], batch: int, drop_last: bool = False) -> list[list[list[int]]]:
    """Every rank's batches of one epoch, the world size changing batch by batch, the global
    batch ``batch`` throughout."""
    order = global_order(n, 0, True, 7)
    pos, out = 0, []
    for world in worlds:
        step = [rank_slice(order, pos, r, world, batch, drop_last) for r in range(world)]
        if not any(step):
            break
        out.append(step)
        pos += min(n - pos, batch)
    return out


@pytest.mark.parametrize("n,batch", [(97, 16), (64, 24), (10, 8), (3, 4)])
def test_every_row_once_whatever_the_sizes(n, batch):
    worlds = [4, 4, 3, 3, 1, 2, 4, 3] * 20
    steps = _epoch(n, worlds, batch)
    full = [step for step in steps if sum(map(len, step)) >= batch]
    assert all(sum(map(len, step)) == batch for step in full), "every full batch is the global batch"
    assert all(max(map(len, s)) - min(map(len, s)) <= 1 for s in steps), "split as evenly as the ranks divide"
    seen = collections.Counter(i for step in steps for ids in step for i in ids)
    assert set(seen) == set(range(n))
    padded = [
        step for step in steps if any(len(ids) == 1 for ids in step) and sum(map(len, step)) > len(set(sum(step, [])))
    ]
    assert all(v == 1 for v in seen.values()) or padded  # only the last, padded batch repeats
    assert all(ids for step in steps for ids in step), "a rank without rows would stall its peers"


def test_drop_last_drops_only_the_short_batch():
    steps = _epoch(10, [2] * 10, 8, drop_last=True)
    assert len(steps) == 1 and sorted(sum(steps[0], [])) == sorted(global_order(10, 0, True, 7)[:8])


def test_loader_follows_the_group_and_a_restore():
    group = {"rank": 0, "world": 2}
    inner = DataLoader(Rows(20), batch_size=3, shuffle=False)
    loader = ExactLoader(inner, lambda: (group["rank"], group["world"]), lambda b: b)
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2]  # rank 0 of 2: rows 0-2, rank 1 takes 3-5
    assert loader.position.rows == 6
    group["world"] = 3  # shrunk in place between batches: the global batch (6) is cut at the new size
    assert next(it).tolist() == [6, 7]
    loader.restore(Position(epoch=0, rows=6))  # a rolled-back step: its rows are served again
    assert next(it).tolist() == [6, 7]
    assert loader.position.rows == 12
    assert len(loader) == 2  # 8 rows left: one global batch of 6 and a short one


def test_set_epoch_starts_the_epoch_over():
    inner = DataLoader(Rows(8), batch_size=2, shuffle=True)
    loader = ExactLoader(inner, lambda: (0, 1), lambda b: b)
    first = torch.cat(list(loader)).tolist()
    assert sorted(first) == list(range(8))
    loader.sampler.set_epoch(1)
    second = torch.cat(list(loader)).tolist()
    assert sorted(second) == list(range(8)) and second != first
