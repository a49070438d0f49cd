"""The global sample order and who consumes which part of it.

An epoch is a permutation of the row indices, drawn from (seed, epoch) alone, so every rank computes the
same one. Global batch `s` is rows `order[s*G:(s+1)*G]` whatever the world size; rank `r` takes the
`r`-th slice of `G/W` rows of it, and DataLoader worker `w` of `n` serves the steps `s` with
`s % n == w`, which a DataLoader's round-robin over its workers puts back in order. The rows left over
after the last full global batch are dropped, so every rank gets the same number of batches per epoch.
A position is (epoch, step in epoch): a job resumed with another world size or worker count, and the
same global batch, continues with exactly the rows not yet delivered.
"""

from __future__ import annotations

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

    def __post_init__(self):
        if self.global_batch_size % self.world_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by "
                             f"world_size={self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is not in [0, world_size={self.world_size})")
        if self.batches_per_epoch == 0:
            raise ValueError(f"{self.num_rows} rows make no global batch of {self.global_batch_size}")

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def rows(self, order: np.ndarray, step: int) -> np.ndarray:
        """This rank's row indices for global batch `step` of the epoch whose order is `order`."""
        start = step * self.global_batch_size + self.rank * self.local_batch_size
        return order[start:start + self.local_batch_size]

    def position(self, steps_done: int) -> tuple[int, int]:
        """(epoch, step in epoch) after `steps_done` global batches since the start of training."""
        return divmod(steps_done, self.batches_per_epoch)
