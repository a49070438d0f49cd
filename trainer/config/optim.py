"""The `optim` section: the optimizer (`optim=adamw|sgd`; its learning-rate schedule is the `lr_schedule`
section's), and whose AdamW steps (`optim.impl=torch|triton`: torch.optim.AdamW, or ops.AdamW's fused kernel)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

from omegaconf import MISSING

from trainer.config.checks import one_of, read_by, require

OPTIMIZERS = ("adamw", "sgd")
IMPLS = ("torch", "triton")


@dataclass
class OptimConfig:
    # Each must be > 0 (`trainer.config.validate` checks it before `check()`).
    POSITIVE: ClassVar[tuple[str, ...]] = ("lr", "eps")
    name: str = MISSING  # the option chosen: adamw or sgd
    lr: float = 3e-3  # the peak learning rate (lr_schedule shapes it over the steps)
    weight_decay: float = 0.1  # decoupled weight decay (AdamW's), on matrices only (not norms, biases or embeddings)
    betas: list[float] = read_by("adamw", default_factory=lambda: [0.9, 0.95])  # AdamW's (beta1, beta2)
    eps: float = read_by("adamw", default=1e-8)  # AdamW's epsilon
    momentum: float = read_by("sgd", default=0.9)  # SGD's momentum
    grad_clip: float | None = 1.0  # the gradients' global norm is clipped to it (null: no clipping)
    # torch: torch.optim's foreach implementation; triton: ops.AdamW (adamw only). null: triton under
    # kernels=triton with optim=adamw, else torch. Either loads the other's checkpoints.
    impl: str | None = None

    def check(self) -> None:
        one_of("optim.name", self.name, OPTIMIZERS)
        require(self.momentum >= 0, "optim.momentum", self.momentum, "must be >= 0")
        require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", list(self.betas),
                "must be two numbers in [0, 1)")
        require(self.grad_clip is None or self.grad_clip > 0, "optim.grad_clip", self.grad_clip,
                "must be > 0, or null for no clipping")
        if self.impl is not None:
            one_of("optim.impl", self.impl, IMPLS)
        require(self.impl != "triton" or self.name == "adamw", "optim.impl", self.impl,
                f"ops has AdamW only: optim={self.name} takes optim.impl=torch")
        require(self.impl != "triton" or importlib.util.find_spec("triton") is not None, "optim.impl", self.impl,
                "needs the triton package: pip install triton")
