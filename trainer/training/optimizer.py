"""The optimizer and its learning-rate schedule, as the `optim` and `lr_schedule` sections set them: the
parameter groups (no weight decay on 1-D parameters), torch.optim's or ops' AdamW (or SGD), linear warmup then
the schedule's decay, and the settings a resumed run takes from its config rather than from the checkpoint it
loads."""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)

# An optimizer's param-group key -> the config key that sets it.
_OPTIM_KEYS = {"initial_lr": "optim.lr", "weight_decay": "optim.weight_decay", "betas": "optim.betas",
               "eps": "optim.eps", "momentum": "optim.momentum"}


def build_optimizer(cfg, model: torch.nn.Module, impl: str) -> torch.optim.Optimizer:
    """The optim section's optimizer over `model`'s trained parameters: torch.optim's foreach AdamW, or ops.AdamW
    where `impl` (the kernel switch's `Kernels.optimizer`) is triton; the two save and load the same state dict."""
    # No weight decay on norms' gains (1-D parameters), as usual for transformers.
    trained = [p for p in model.parameters() if p.requires_grad]  # not a frozen base (peft=lora)
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    # An empty group (LoRA trains no 1-D parameter) is left out: a checkpoint's optimizer state is kept per
    # parameter name, and torch.distributed.checkpoint cannot place a group without parameters.
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if cfg.name == "adamw":
        if impl == "triton":
            import ops

            return ops.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)


# The share of the base rate left after the warmup, at `progress` (0 to 1) of the decay: TorchTitan's decay types.
_DECAYS = {
    "cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1 - progress,
    "sqrt": lambda progress: 1 - math.sqrt(progress),
    "constant": lambda progress: 1.0,
}


def lr_factor(step: int, warmup: int, total: int, min_factor: float, decay: str = "cosine") -> float:
    """Linear warmup to 1, then `decay` to `min_factor` at `total` (a constant schedule stays at 1)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_factor + (1 - min_factor) * _DECAYS[decay](progress)


def build_lr_schedule(cfg, optimizer: torch.optim.Optimizer, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr_schedule section's schedule over `optimizer`: `lr_schedule.warmup_steps` of linear warmup, then
    its decay to `lr_schedule.min_lr_factor` of `optim.lr` at `max_steps` (train.max_steps)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, max_steps, cfg.min_lr_factor, cfg.name))


def settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings (all but its parameters): what `keep_configured` restores after a load."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _plain(value):
    """A setting comparable whatever the checkpoint stored it as (betas come back as a list or a tensor)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return tuple(_plain(v) for v in value) if isinstance(value, list | tuple) else value


def keep_configured(optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LambdaLR,
                    configured: list[dict], path: str) -> None:
    """Loading the optimizer brings back the settings it was saved with; the run's config (`configured`,
    `settings` before the load) wins instead, so a resumed run with another optim.lr (or weight decay, betas,
    eps, momentum) trains with it, its schedule continued from the step reached, and the log says what
    changed."""
    for i, (group, mine) in enumerate(zip(optimizer.param_groups, configured, strict=True)):
        for key, value in mine.items():
            saved = group.get(key)
            if key == "lr" or _plain(saved) == _plain(value):
                continue  # lr: the schedule's value at the step reached, set below
            if key in _OPTIM_KEYS and i == 0:  # the groups differ only in weight decay, 0 for group 1
                log.warning("%s: the checkpoint %s was trained with %s; this run goes on with %s",
                            _OPTIM_KEYS[key], path, _plain(saved), _plain(value))
            group[key] = value
        schedule.base_lrs[i] = group["initial_lr"]
        group["lr"] = group["initial_lr"] * schedule.lr_lambdas[i](schedule.last_epoch)
