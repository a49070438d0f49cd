"""`LocalDataset`: fixed-length token rows read straight from Parquet, in process, no server.

Each item is one step's batch for this rank, `{"tokens": Tensor(local_batch, row_len)}` of the stored
integer type (as `StreamingDataset` gives it: widen it with `.long()` where it is used, on the device), so
use it with `DataLoader(ds, batch_size=None, num_workers=n)`. Order, sharding and resumption are
`PlannedDataset`'s, the same as the Flight-backed `StreamingDataset`'s.
"""

from __future__ import annotations

import numpy as np
import torch

from datacache.order import BatchPlan
from datacache.parquet import read_token_rows
from datacache.planned import PlannedDataset, rank_and_world


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
