"""`LocalDataset`: fixed-length token rows read straight from Parquet, in process, no server.

Each item is one step's batch for this rank, `{"tokens": LongTensor(local_batch, row_len)}`, so use it
with `DataLoader(ds, batch_size=None, num_workers=n)`. The rank comes from `torch.distributed` when it is
initialised (else RANK / WORLD_SIZE from the environment, else 0 of 1); the order is `BatchPlan`'s.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from datacache.order import BatchPlan


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def parquet_files(path: str) -> list[str]:
    """The Parquet files named by `path`: a file, a directory (searched recursively) or a glob."""
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True))
    return sorted(glob.glob(path))


def read_token_rows(path: str, column: str = "tokens") -> np.ndarray:
    """All rows of a fixed-length token-list column, as a 2-D array (rows, row_len)."""
    files = parquet_files(path)
    if not files:
        raise FileNotFoundError(f"no Parquet files at {path!r}")
    table = pq.read_table(files, columns=[column]) if len(files) > 1 else pq.read_table(files[0], columns=[column])
    col = table.column(column).combine_chunks()
    if not pa.types.is_fixed_size_list(col.type):
        raise TypeError(f"column {column!r} in {path!r} is {col.type}, not a fixed-size list of token ids")
    return col.values.to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)


class LocalDataset(IterableDataset):
    def __init__(self, path: str, global_batch_size: int, column: str = "tokens", shuffle: bool = True,
                 seed: int = 0, loop: bool = True, rank: int | None = None, world_size: int | None = None):
        self.rows = read_token_rows(path, column)
        env_rank, env_world = _rank_and_world()
        self.plan = BatchPlan(
            num_rows=len(self.rows), global_batch_size=global_batch_size,
            world_size=env_world if world_size is None else world_size,
            rank=env_rank if rank is None else rank, shuffle=shuffle, seed=seed,
        )
        self.loop = loop
        self.epoch, self.step = 0, 0

    def set_position(self, epoch: int, step: int) -> None:
        """Start the next iteration at global batch `step` of `epoch`."""
        if not 0 <= step < self.plan.batches_per_epoch:
            raise ValueError(f"step {step} is outside the epoch's {self.plan.batches_per_epoch} batches")
        self.epoch, self.step = epoch, step

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        epoch, step, k = self.epoch, self.step, 0
        while True:
            order = self.plan.epoch_order(epoch)
            while step < self.plan.batches_per_epoch:
                if k % num_workers == worker:
                    rows = self.plan.rows(order, step)
                    yield {"tokens": torch.from_numpy(self.rows[rows].astype(np.int64))}
                step, k = step + 1, k + 1
            if not self.loop:
                return
            epoch, step = epoch + 1, 0
