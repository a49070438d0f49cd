"""The recipes, `recipe=pretrain|sft|dpo|kto|grpo|rloo|ppo|reward|kd`: one object each (`trainer.recipes.base.Recipe`)
that owns what a run's loss counts, its eval loss and, for dpo, kto, grpo and rloo, its frozen reference, for kd its
teacher. The section's schema and checks are in `trainer.config.recipe` (no torch there: the driver imports it);
`build` makes a run's recipe object."""

from __future__ import annotations

import importlib

# recipe.name -> (module, class) of its object; imported when built, so that the driver imports no torch here.
OBJECTS = {
    "pretrain": ("trainer.recipes.pretrain", "Pretrain"),
    "sft": ("trainer.recipes.sft", "SFT"),
    "dpo": ("trainer.recipes.dpo", "DPO"),
    "kto": ("trainer.recipes.kto", "KTO"),
    "grpo": ("trainer.recipes.grpo", "GRPO"),
    "rloo": ("trainer.recipes.rloo", "RLOO"),
    "reward": ("trainer.recipes.reward", "Reward"),
    "kd": ("trainer.recipes.kd", "KD"),
    "ppo": ("trainer.recipes.ppo", "PPO"),
}


def build(cfg, model, ctx):
    """The recipe object of run `cfg` (the typed config) for the policy `model` on this rank."""
    module, name = OBJECTS[cfg.recipe.name]
    return getattr(importlib.import_module(module), name)(cfg, model, ctx)
