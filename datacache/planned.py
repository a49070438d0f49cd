"""`PlannedDataset`: an IterableDataset that yields this rank's batch of each global step of a `BatchPlan`.

DataLoader worker `w` of `n` serves the steps `g` with `g % n == w` (counting from the start position),
which the DataLoader's round-robin over its workers puts back in order. The position is the absolute
global step `epoch * batches_per_epoch + step`: `set_position(epoch, step)` starts any loader (any worker
count, any world size with the same global batch) exactly there, and `state_dict()`/`load_state_dict()`
carry each iterator's own next step, as torchdata's StatefulDataLoader expects of a dataset. An iteration
ends with the epoch it starts in (`loop=False`), or goes on through the epochs that follow (`loop=True`).
Subclasses say how to fetch rows: `fetch(row_indices) -> {"tokens": tensor}`, and may give their plan
later (`_make_plan`, called where the plan is first needed: a dataset that must ask servers how many rows
there are asks in the process that iterates it).
"""

from __future__ import annotations

import abc
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from datacache.order import BatchPlan


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: torch.distributed's when initialised, else RANK/WORLD_SIZE."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def plan_arguments(batch_size: int | None, global_batch_size: int | None, rank: int | None,
                   world_size: int | None, **rest) -> dict[str, Any]:
    """`BatchPlan`'s arguments but its rows, from a dataset's: exactly one of `batch_size` (per rank) and
    `global_batch_size`; rank and world size from `rank_and_world()` where not given. Checked as a plan of one
    global batch would be, so a bad value fails before any data is read."""
    if (batch_size is None) == (global_batch_size is None):
        raise ValueError("give exactly one of batch_size (per rank) and global_batch_size")
    env_rank, env_world = rank_and_world()
    world = env_world if world_size is None else world_size
    args = dict(global_batch_size=global_batch_size or batch_size * world, world_size=world,
                rank=env_rank if rank is None else rank, **rest)
    BatchPlan(num_rows=args["global_batch_size"], **args)
    return args


class PlannedDataset(IterableDataset, abc.ABC):
    def __init__(self, plan: BatchPlan | None, loop: bool):
        self._plan, self.loop = plan, loop
        self._start = 0          # absolute global step where the next iteration starts
        self._position = None    # (epoch, step) from set_position, made absolute once the plan is known
        self._resumed = False    # True when _start is this worker's own next step (from load_state_dict)
        self._next = 0

    @property
    def plan(self) -> BatchPlan:
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> BatchPlan:
        raise NotImplementedError("give PlannedDataset a plan, or override _make_plan")

    @abc.abstractmethod
    def fetch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """This rank's rows `rows` (indices into the global row space), as tensors."""

    def set_epoch(self, epoch: int) -> None:
        self.set_position(epoch, 0)

    def set_position(self, epoch: int, step: int) -> None:
        """Start the next iteration at global batch `step` of `epoch` (checked now if the plan is known, else
        when the iteration starts)."""
        self._position, self._resumed = (epoch, step), False
        if self._plan is not None:
            self._apply_position()

    def _apply_position(self) -> None:
        if self._position is None:
            return
        (epoch, step), self._position = self._position, None
        if not 0 <= step < self.plan.batches_per_epoch:
            raise ValueError(f"step {step} is outside the epoch's {self.plan.batches_per_epoch} batches")
        self._start = epoch * self.plan.batches_per_epoch + step

    def state_dict(self) -> dict[str, Any]:
        if self._position is not None and self._plan is not None:  # a set_position not yet iterated
            self._apply_position()
            self._next = self._start
        epoch, step = divmod(self._next, self.plan.batches_per_epoch)
        return {"next_step": self._next, "epoch": epoch, "step": step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start, self._resumed, self._position = int(state["next_step"]), True, None
        self._next = self._start

    def _planned(self, first: int, stride: int, end: int | None):
        """(global step, this rank's rows) for steps first, first + stride, ... before `end`."""
        per_epoch, epoch, order, g = self.plan.batches_per_epoch, None, None, first
        while end is None or g < end:
            e, step = divmod(g, per_epoch)
            if e != epoch:
                epoch, order = e, self.plan.epoch_order(e)
            yield g, self.plan.rows(order, step)
            g += stride

    def _fetched(self, planned):
        """(global step, batch) for each planned step; subclasses may fetch ahead."""
        for g, rows in planned:
            yield g, self.fetch(rows)

    def __iter__(self):
        # Not a generator itself: the position is fixed when iter() is called, so a state_dict taken before
        # the first batch (as StatefulDataLoader takes each worker's) already names this worker's first step.
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        self._apply_position()
        per_epoch = self.plan.batches_per_epoch
        first = self._start if self._resumed else self._start + worker
        end = (self._start // per_epoch + 1) * per_epoch if not self.loop else None
        self._next = first
        return self._batches(first, workers, end)

    def _batches(self, first: int, workers: int, end: int | None):
        for g, batch in self._fetched(self._planned(first, workers, end)):
            self._next = g + workers
            yield batch
