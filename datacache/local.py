"""`LocalDataset`: rows read straight from Parquet files into memory, in process, no server.

It takes `StreamingDataset`'s arguments with Parquet files (a file, a directory, a glob, or a list of those)
in place of endpoints, and yields the same batches: one step's batch for this rank,
`{column: Tensor(local_batch, ...)}` for each of `columns` (a fixed-size list column as 2-D, a number
column as 1-D) of the stored type (widen token ids with `.long()` where they are used, on the device). Use it
with `DataLoader(ds, batch_size=None, num_workers=n)`. Order, sharding and resumption are `PlannedDataset`'s,
the same as `StreamingDataset`'s; one `iter()` is one epoch unless `loop=True`.
"""

from __future__ import annotations

import numpy as np
import torch

from datacache.order import BatchPlan
from datacache.parquet import read_columns, read_token_rows
from datacache.planned import PlannedDataset, plan_arguments

__all__ = ["LocalDataset", "read_token_rows"]


class LocalDataset(PlannedDataset):
    def __init__(self, paths: str | list[str], columns: list[str] | tuple[str, ...] = ("tokens",),
                 batch_size: int | None = None, global_batch_size: int | None = None, shuffle: bool = True,
                 seed: int = 0, loop: bool = False, drop_last: bool = True, rank: int | None = None,
                 world_size: int | None = None, block_rows: int = 1, window_blocks: int = 1):
        if isinstance(columns, str):
            raise TypeError(f"columns={columns!r}: give a list of column names, such as [{columns!r}]")
        self.columns = list(columns)
        args = plan_arguments(batch_size, global_batch_size, rank, world_size, shuffle=shuffle, seed=seed,
                              drop_last=drop_last, block_rows=block_rows, window_blocks=window_blocks)
        self.arrays = read_columns(paths, self.columns)
        super().__init__(BatchPlan(num_rows=len(self.rows), **args), loop)

    @property
    def rows(self) -> np.ndarray:
        """The first column's rows (the token rows, for a dataset of `columns=["tokens", ...]`)."""
        return self.arrays[self.columns[0]]

    def fetch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        return {c: torch.from_numpy(self.arrays[c][rows]) for c in self.columns}
