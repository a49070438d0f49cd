"""The `recipe` section: which loss a run trains with, and the rules that tie it to the data and model."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING, OmegaConf

RECIPES = ("pretrain", "sft")


@dataclass
class RecipeConfig:
    # pretrain: next-token loss on every token; sft: only on the assistant's tokens of data=chat.
    name: str = MISSING


def check(cfg) -> None:
    """Raise ConfigError when the recipe, the data and the model do not fit together."""
    from trainer.config import ConfigError

    recipe = OmegaConf.select(cfg, "recipe.name", default="pretrain")
    if recipe not in RECIPES:
        raise ConfigError("recipe", recipe, f"must be one of {', '.join(RECIPES)}")
    data = cfg.data.name
    if recipe == "sft" and data != "chat":
        raise ConfigError("data", data, "recipe=sft trains on conversations: use data=chat (rows with 'messages')")
    if data == "chat":
        if recipe != "sft":
            raise ConfigError("recipe", recipe, "data=chat is for recipe=sft (the loss on the assistant's tokens)")
        if cfg.model.name != "hf":
            raise ConfigError(
                "model",
                cfg.model.name,
                "data=chat tokenizes with the model directory's tokenizer "
                "and chat template: use model=hf model.path=<directory>",
            )
        if not cfg.data.path:
            raise ConfigError(
                "data.path",
                cfg.data.path,
                "data=chat needs a JSONL file, or Parquet files, of rows with OpenAI-style 'messages'",
            )
        c = cfg.data.cache
        if c.endpoints or c.eval_endpoints or c.nodes:
            raise ConfigError(
                "data.cache",
                "set",
                "data=chat is read from its local corpus; cache nodes serve "
                "token rows of data=stdlib or data=parquet only",
            )
