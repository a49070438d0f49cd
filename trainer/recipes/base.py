"""`Recipe`, what every recipe object is: the loop hands it each step's batch and asks for the micro-batches'
losses, the eval loss of an eval batch, and the recipe's own numbers for a metrics line. The loop never looks
inside a batch; a recipe holds whatever else its loss needs (recipe=dpo and recipe=grpo their frozen reference,
recipe=kd its teacher, recipe=grpo its generation batch). `Context` is what a recipe shares with the loop."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.models.kernels import Kernels
from trainer.observability import metrics
from trainer.parallel import ParallelDims


@dataclass
class Context:
    device: torch.device
    dims: ParallelDims
    autocast: contextlib.AbstractContextManager  # bf16 autocast, or nothing (reusable)
    loss_context: Callable[[], contextlib.AbstractContextManager]  # loss parallelism under tp, else nothing
    kernels: Kernels  # the run's kernel switch: the models a recipe assembles, its token log-probabilities
    pipeline: Any = None  # strategy.pp > 1: the `trainer.parallel.pipeline.Pipeline` that runs the model's stages
    # A micro-batch loss's backward: the tensor's own, or the DeepSpeed engine's (strategy=deepspeed).
    backward: Callable[[torch.Tensor], Any] = torch.Tensor.backward


class Recipe(abc.ABC):
    """The defaults: every step reads one global batch of `train.global_batch_size` rows."""

    def __init__(self, cfg, model: nn.Module, ctx: Context):
        self.cfg, self.model, self.ctx = cfg, model, ctx
        self.stats: dict[str, torch.Tensor] = {}  # summed over the steps since the last metrics line
        # The loop's iterator over the train split: a recipe that reads ahead (recipe.generation.async) takes its
        # batches from it, and asks the loop for none (`wants_batch`).
        self.source = None
        # This rank's real (non-padding) input tokens and the tokens its loss counted, since the last metrics line.
        self.counted: dict[str, torch.Tensor | int] = {"tokens": 0, "trained_tokens": 0}

    @property
    def rows_per_step(self) -> int:
        """The rows of data one global batch holds."""
        return self.cfg.train.global_batch_size

    def data_steps(self, step: int) -> int:
        """How many global batches of data the steps before `step` read (where a resumed run goes on)."""
        return step

    def wants_batch(self, step: int) -> bool:
        """Whether step `step` (from 0) reads a new batch; when not, it is given None."""
        return True

    @abc.abstractmethod
    def micro_batches(self, batch: dict | None, accum: int) -> list:
        """The step's `accum` micro-batches, in the form `loss` takes them."""

    @abc.abstractmethod
    def loss(self, micro) -> torch.Tensor:
        """A micro-batch's part of the step's loss (`step` calls backward on it)."""

    def step(self, micro) -> torch.Tensor:
        """A micro-batch's forward and backward (the loop holds `loss_context()`); its part of the loss, detached."""
        loss = self.loss(micro)
        self.ctx.backward(loss)
        return local(loss.detach())

    @abc.abstractmethod
    def eval_loss(self, batch: dict) -> torch.Tensor:
        """An eval batch's loss, weighted so that the mean over batches and ranks is the split's."""

    def tokens(self, batch: dict) -> torch.Tensor:
        """The batch's token ids on the device, widened there (batches keep their stored type, often int32)."""
        return batch["tokens"].to(self.ctx.device, non_blocking=True).long()

    def add_stats(self, stats: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        for key, value in stats.items():
            self.stats[key] = self.stats.get(key, 0) + value * weight

    def count(self, tokens: torch.Tensor | int, trained: torch.Tensor | int) -> None:
        """A step's real input tokens (padding left out) and the tokens its loss counts, on this rank."""
        self.counted["tokens"] = self.counted["tokens"] + tokens
        self.counted["trained_tokens"] = self.counted["trained_tokens"] + trained

    def take_counts(self) -> dict[str, float]:
        """The real and trained tokens of every data-parallel rank since the last call (tensor- and pipeline-
        parallel peers hold the same rows: the mean over the world times the data-parallel degree)."""
        values = torch.tensor([float(self.counted[k]) for k in ("tokens", "trained_tokens")], dtype=torch.float64,
                              device=self.ctx.device)
        self.counted = {"tokens": 0, "trained_tokens": 0}
        dp = self.ctx.dims.data_parallel_rank()[1]
        if dist.is_initialized():
            dist.all_reduce(values)
            values = values / dist.get_world_size()
        tokens, trained = (round(float(v) * dp) for v in values)
        return {"tokens": tokens, "trained_tokens": trained}

    def record(self, steps: int) -> dict[str, float]:
        """The recipe's numbers of the `steps` steps since the last metrics line, averaged over them and the
        ranks; then they start again from nothing."""
        record = {k: metrics.mean_across_ranks(v / steps) for k, v in sorted(self.stats.items())}
        self.stats = {}
        return record

    @contextlib.contextmanager
    def kept_stats(self):
        """Inside, statistics are dropped afterwards (an eval does not count in the training line)."""
        saved, self.stats = self.stats, {}
        try:
            yield
        finally:
            self.stats = saved


def local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a replicated DTensor (the loss under loss parallelism) gives its local copy."""
    return t.to_local() if hasattr(t, "to_local") else t
