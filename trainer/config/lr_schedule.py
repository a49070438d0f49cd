"""The `lr_schedule` section: how the learning rate moves over a run, TorchTitan's `lr_scheduler` by its
names. `warmup_steps` of linear warmup, then the decay the option names (`lr_schedule=cosine|linear|sqrt|
constant`: TorchTitan's `decay_type`, and no decay) down to `min_lr_factor` x optim.lr at train.max_steps."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from trainer.config.checks import one_of, require

DECAYS = ("cosine", "linear", "sqrt", "constant")


@dataclass
class LRScheduleConfig:
    name: str = MISSING  # the decay after the warmup: cosine, linear, sqrt (1 - sqrt(progress)) or constant
    # Steps of linear warmup: the factor is (step + 1) / (warmup_steps + 1) over them.
    warmup_steps: int = 20
    # Where the decay ends, at train.max_steps: this fraction of optim.lr.
    min_lr_factor: float = 0.1

    def check(self) -> None:
        one_of("lr_schedule.name", self.name, DECAYS)
        require(self.warmup_steps >= 0, "lr_schedule.warmup_steps", self.warmup_steps, "must be >= 0")
        require(0 <= self.min_lr_factor <= 1, "lr_schedule.min_lr_factor", self.min_lr_factor, "must be in [0, 1]")
