"""The global sample order and who consumes which part of it.

An epoch's order is drawn from (seed, epoch) alone, so every rank computes the same one. With
`block_rows=1` it is a full permutation of the rows; with larger blocks, contiguous blocks of rows are
permuted and then rows are shuffled within windows of `window_blocks` blocks, so that a streaming reader
fetches long runs of neighbouring rows (the shuffle MosaicML Streaming and WebDataset use).

Global batch `s` is rows `order[s*G:(s+1)*G]` whatever the world size; rank `r` takes the `r`-th slice of
`G/W` rows of it. With `drop_last` the rows after the last full global batch wait for the next epoch;
without it the last batch is padded with rows from the start of the epoch's order (seen twice, or more
often when the rows are fewer than one global batch). Either
way every rank gets the same number of batches, which collective training needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchPlan:
    num_rows: int
    global_batch_size: int
    world_size: int = 1
    rank: int = 0
    shuffle: bool = True
    seed: int = 0
    block_rows: int = 1
    window_blocks: int = 1
    drop_last: bool = True

    def __post_init__(self):
        if self.global_batch_size % self.world_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by "
                             f"world_size={self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is not in [0, world_size={self.world_size})")
        if self.block_rows < 1 or self.window_blocks < 1:
            raise ValueError(f"block_rows={self.block_rows} and window_blocks={self.window_blocks} must be >= 1")
        if self.batches_per_epoch == 0:
            raise ValueError(f"{self.num_rows} rows make no global batch of {self.global_batch_size}")

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_rows // self.global_batch_size
        return math.ceil(self.num_rows / self.global_batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        n = self.num_rows
        if not self.shuffle:
            order = np.arange(n)
        else:
            rng = np.random.default_rng([self.seed, epoch])
            if self.block_rows == 1:
                order = rng.permutation(n)
            else:
                starts = rng.permutation(np.arange(0, n, self.block_rows))
                order = np.concatenate([np.arange(s, min(s + self.block_rows, n)) for s in starts])
                window = self.block_rows * self.window_blocks
                for lo in range(0, n, window):
                    rng.shuffle(order[lo:lo + window])
        if not self.drop_last and n % self.global_batch_size:
            # Repeats the order from its start (more than once when the rows are fewer than one batch).
            order = np.resize(order, self.batches_per_epoch * self.global_batch_size)
        return order

    def rows(self, order: np.ndarray, step: int) -> np.ndarray:
        """This rank's row indices for global batch `step` of the epoch whose order is `order`."""
        start = step * self.global_batch_size + self.rank * self.local_batch_size
        return order[start:start + self.local_batch_size]

    def position(self, steps_done: int) -> tuple[int, int]:
        """(epoch, step in epoch) after `steps_done` global batches since the start of training."""
        return divmod(steps_done, self.batches_per_epoch)
