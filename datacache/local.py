"""`LocalDataset`: fixed-length token rows read straight from Parquet, in process, no server.

Each item is one step's batch for this rank, `{"tokens": Tensor(local_batch, row_len)}` of the stored
integer type (as `StreamingDataset` gives it: widen it with `.long()` where it is used, on the device), so
use it with `DataLoader(ds, batch_size=None, num_workers=n)`. Order, sharding and resumption are
`PlannedDataset`'s, the same as the Flight-backed `StreamingDataset`'s.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from datacache.order import BatchPlan
from datacache.planned import PlannedDataset, rank_and_world


def parquet_files(path: str) -> list[str]:
    """The Parquet files named by `path`: a file, a directory (searched recursively) or a glob."""
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True))
    return sorted(glob.glob(path))


def token_matrix(column: pa.ChunkedArray | pa.Array, what: str) -> np.ndarray:
    """A fixed-size list column as a 2-D array (rows, row_len), zero-copy when it is one chunk."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not pa.types.is_fixed_size_list(column.type):
        raise TypeError(f"{what} is {column.type}, not a fixed-size list of token ids")
    values = column.values.to_numpy(zero_copy_only=False)
    return values.reshape(len(column), column.type.list_size)


def read_token_rows(path: str, column: str = "tokens") -> np.ndarray:
    """All rows of a fixed-length token-list column, as a 2-D array (rows, row_len)."""
    files = parquet_files(path)
    if not files:
        raise FileNotFoundError(f"no Parquet files at {path!r}")
    table = pq.read_table(files if len(files) > 1 else files[0], columns=[column])
    return token_matrix(table.column(column), f"column {column!r} in {path!r}")


class LocalDataset(PlannedDataset):
    def __init__(self, path: str, global_batch_size: int, column: str = "tokens", shuffle: bool = True,
                 seed: int = 0, loop: bool = True, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = True, block_rows: int = 1, window_blocks: int = 1):
        self.rows = read_token_rows(path, column)
        env_rank, env_world = rank_and_world()
        super().__init__(BatchPlan(
            num_rows=len(self.rows), global_batch_size=global_batch_size,
            world_size=env_world if world_size is None else world_size,
            rank=env_rank if rank is None else rank, shuffle=shuffle, seed=seed, drop_last=drop_last,
            block_rows=block_rows, window_blocks=window_blocks,
        ), loop)

    def fetch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        return {"tokens": torch.from_numpy(self.rows[rows])}
