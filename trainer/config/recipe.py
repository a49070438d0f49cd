"""The `recipe` section: which loss a run trains with (`recipe=pretrain|sft|dpo`). The rules that tie it to
the data and the model are cross-section rules (`trainer.config.across`)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from trainer.config.checks import one_of, require

RECIPES = ("pretrain", "sft", "dpo")
# The data each recipe trains on, and the recipe each conversational dataset is for.
DATA = {"sft": "chat", "dpo": "preference"}


@dataclass
class RecipeConfig:
    # pretrain: next-token loss on every token; sft: only on the assistant's tokens of data=chat;
    # dpo: Direct Preference Optimization on data=preference against the frozen starting model.
    name: str = MISSING
    beta: float = 0.1  # dpo: how far from the reference the policy may move (the KL penalty's inverse weight)

    def check(self) -> None:
        one_of("recipe", self.name, RECIPES)
        if self.name == "dpo":
            require(self.beta > 0, "recipe.beta", self.beta, "must be > 0")
