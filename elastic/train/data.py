"""Data that stays exact across resizes: each rank's part of the rows not yet trained in
this epoch, recomputed from one global position whenever the group changes.

An epoch is one global order of the dataset's rows (a permutation seeded by the epoch when
the loader shuffles, the identity otherwise). The group consumes it from the front, one
global batch at a time. The global batch is fixed when the loader is made (or a shard's
``iter_batches`` is first called with a batch size): the DataLoader's ``batch_size`` times the
group's size then, as Ray Train's would be. At position ``p`` with ``world`` ranks, the next
``global_batch`` rows of the order are split among the ranks in rank order, as evenly as they
divide (the first ``global_batch % world`` ranks take one row more), and the position advances
by ``global_batch``. Every rank computes the same position from the same history, so nothing
is exchanged per batch.

When the group is re-formed in place (the step guard: ``elastic/train/step_guard.py``) the
loop is not entered again, and its loader keeps its global batch: each rank's share grows
(48 rows are 12 a rank at 4 ranks, 16 at 3), so the loop's steps per epoch, learning-rate
schedule and optimizer see the batch they were tuned for. When the loop is entered again
(a re-entry from a checkpoint, or growth) it makes its loader again, at the new size. Either
way the position is where the last trained batch left it (the checkpoint carries it on
re-entry, the step guard's snapshot in place), and the rest of the epoch is split at the new
size: a row is trained exactly once per epoch.

The final global batch of an epoch may be short. Its rows are split as evenly as the ranks
allow; when fewer rows than ranks remain, each rank without a row of its own repeats one
of them (as ``DistributedSampler`` pads), so every rank still takes a step.
``drop_last`` drops the short batch instead.

``ExactLoader`` wraps a ``torch.utils.data.DataLoader`` over a map-style dataset (what
``prepare_data_loader`` returns); ``ExactShard`` serves a Ray Dataset
(``get_dataset_shard``) with ``iter_batches``, ``iter_torch_batches`` and ``iter_rows``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler


@dataclass
class Position:
    """Where an epoch stands: ``rows`` of its global order consumed (by completed batches)."""

    epoch: int = 0
    rows: int = 0
    done: bool = False  # the epoch's last batch was served: the next pass starts a new epoch

    def as_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "rows": self.rows, "done": self.done}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Position:
        return cls(int(d.get("epoch", 0)), int(d.get("rows", 0)), bool(d.get("done", False)))


def global_order(n: int, epoch: int, shuffle: bool, seed: int) -> list[int]:
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def rank_slice(order: list[int], start: int, rank: int, world: int, global_batch: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s rows of the global batch that begins at ``start`` (empty: the epoch is over)."""
    take = batch_rows(len(order) - start, global_batch)
    if take <= 0 or (drop_last and take < global_batch):
        return []
    if take < world:  # pad: a rank without a row of its own repeats one, so every rank steps
        return [order[start + (rank % take)]]
    share, extra = divmod(take, world)
    lo = start + rank * share + min(rank, extra)
    return order[lo : lo + share + (1 if rank < extra else 0)]


def batch_rows(left: int, global_batch: int) -> int:
    """Global rows a batch consumes when ``left`` remain."""
    return max(0, min(left, global_batch))


class _Sampler:
    """What ``loader.sampler`` is: ``set_epoch`` (Ray Train's ``DistributedSampler`` call)."""

    def __init__(self, owner: _Positioned):
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class _Positioned:
    """The shared part of a loader and a shard: the position, the group, the epoch's order."""

    def __init__(
        self,
        n_rows: int,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        group: Callable[[], tuple[int, int]],
        seed: int,
    ):
        self.n_rows = n_rows
        self.batch_size = int(batch_size)  # as asked: rows per rank at the size it was asked at
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self._group = group  # () -> (rank, world), read at every batch
        self.global_batch = self.batch_size * group()[1]
        self.position = Position()
        self.sampler = _Sampler(self)
        self.served: list[int] = []  # this rank's row ids of the batch last served (for ledgers)
        self.rows_served = 0  # rows this rank served since the last report read it (throughput)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.position.epoch:
            self.position = Position(epoch=epoch)

    def restore(self, position: Position) -> None:
        """Continue from ``position`` (a checkpoint's or a snapshot's); the next batch is re-cut."""
        self.position = Position(position.epoch, position.rows, position.done)

    def _pass(self) -> Iterator[tuple[list[int], int]]:
        """This rank's row ids batch by batch, with the global rows each consumes."""
        if self.position.done or self.position.rows >= self.n_rows:
            self.position = Position(epoch=self.position.epoch)
        order = global_order(self.n_rows, self.position.epoch, self.shuffle, self.seed)
        while True:
            rank, world = self._group()
            start = self.position.rows
            ids = rank_slice(order, start, rank, world, self.global_batch, self.drop_last)
            if not ids:
                self.position.done = True
                return
            yield ids, batch_rows(self.n_rows - start, self.global_batch)

    def _ask(self, batch_size: int) -> None:
        """A batch size asked again (a shard's ``iter_batches``): the same one keeps the global
        batch fixed when it was first asked; another fixes a new one at the group's size now."""
        if batch_size != self.batch_size:
            self.batch_size = batch_size
            self.global_batch = batch_size * self._group()[1]

    def __len__(self) -> int:
        left = max(0, self.n_rows - (0 if self.position.done else self.position.rows))
        full, rest = divmod(left, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)


class ExactLoader(_Positioned):
    """A DataLoader whose batches are this rank's share of the rows not yet trained this epoch."""

    def __init__(
        self, loader: DataLoader, group: Callable[[], tuple[int, int]], move: Callable[[Any], Any], seed: int = 0
    ):
        if loader.batch_size is None:
            raise ValueError(
                "prepare_data_loader: the DataLoader needs a batch_size (a batch_sampler is not supported)"
            )
        try:
            n = len(loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(
                "prepare_data_loader: the DataLoader's dataset must be map-style (have a length)"
            ) from None
        super().__init__(n, loader.batch_size, isinstance(loader.sampler, RandomSampler), loader.drop_last, group, seed)
        self.loader = loader
        self.dataset = loader.dataset
        self._move = move

    def __iter__(self) -> Iterator[Any]:
        for ids, consumed in self._pass():
            batch = self.loader.collate_fn([self.dataset[i] for i in ids])
            self.served = ids
            self.rows_served += len(ids)
            self.position.rows += consumed
            yield self._move(batch)


class ExactShard(_Positioned):
    """A Ray Dataset's rows as this rank's share (``get_dataset_shard``), materialized once.

    ``blocks`` are the dataset's materialized blocks (object refs) with their row counts;
    a rank fetches only the blocks its rows are in. ``split``: False for a dataset every rank
    reads whole (``DataConfig.datasets_to_split``)."""

    def __init__(self, blocks: list[tuple[Any, int]], group: Callable[[], tuple[int, int]], split: bool, device: Any):
        self._blocks = blocks
        self._starts = []
        total = 0
        for _, n in blocks:
            self._starts.append(total)
            total += n
        whole: Callable[[], tuple[int, int]] = lambda: (0, 1)  # noqa: E731
        super().__init__(total, 1, False, False, group if split else whole, 0)
        self._cache: dict[int, Any] = {}
        self._device = device

    def count(self) -> int:
        return self.n_rows

    def _block(self, i: int) -> Any:
        if i not in self._cache:
            import ray

            self._cache = {i: ray.get(self._blocks[i][0], timeout=120)}  # keep one block: the reads are in order
        return self._cache[i]

    def _take(self, ids: list[int]) -> Any:
        import bisect

        import pyarrow as pa

        tables = []
        for row in ids:
            b = bisect.bisect_right(self._starts, row) - 1
            block = self._block(b)
            table = block if isinstance(block, pa.Table) else pa.Table.from_pandas(block)
            tables.append(table.slice(row - self._starts[b], 1))
        return pa.concat_tables(tables)

    def iter_batches(
        self, *, batch_size: int | None = 256, batch_format: str = "default", drop_last: bool = False, **_: Any
    ) -> Iterator[Any]:
        self._ask(int(batch_size or self.n_rows or 1))
        self.drop_last = drop_last
        for ids, consumed in self._pass():
            table = self._take(ids)
            self.served = ids
            self.rows_served += len(ids)
            self.position.rows += consumed
            yield _format(table, batch_format)

    def iter_torch_batches(
        self,
        *,
        batch_size: int | None = 256,
        dtypes: Any = None,
        device: Any = "auto",
        collate_fn: Callable[[Any], Any] | None = None,
        drop_last: bool = False,
        **_: Any,
    ) -> Iterator[Any]:
        target = self._device if device == "auto" else device
        for batch in self.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=drop_last):
            if collate_fn is not None:
                yield collate_fn(batch)
                continue
            out = {}
            for key, value in batch.items():
                dtype = dtypes.get(key) if isinstance(dtypes, dict) else dtypes
                out[key] = torch.as_tensor(value, dtype=dtype, device=target)
            yield out

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        for batch in self.iter_batches(batch_size=1, batch_format="pyarrow"):
            yield from batch.to_pylist()


def _format(table: Any, batch_format: str) -> Any:
    import numpy as np

    if batch_format in ("default", "numpy"):
        out = {}
        for name in table.column_names:
            col = table.column(name).to_pylist()
            out[name] = np.asarray(col)
        return out
    if batch_format == "pandas":
        return table.to_pandas()
    if batch_format == "pyarrow":
        return table
    raise ValueError(f"iter_batches: batch_format must be default, numpy, pandas or pyarrow, got {batch_format!r}")
