"""The `recipe` section: which loss a run trains with, and the rules that tie it to the data and model."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from trainer.config.errors import ConfigError

RECIPES = ("pretrain", "sft", "dpo")
# The data each recipe trains on, and the recipe each conversational dataset is for.
DATA = {"sft": "chat", "dpo": "preference"}


@dataclass
class RecipeConfig:
    # pretrain: next-token loss on every token; sft: only on the assistant's tokens of data=chat;
    # dpo: Direct Preference Optimization on data=preference against the frozen starting model.
    name: str = MISSING
    beta: float = 0.1  # dpo: how far from the reference the policy may move (the KL penalty's inverse weight)


def check(cfg) -> None:
    """Raise ConfigError when the recipe, the data and the model (the typed config) do not fit together."""
    recipe = cfg.recipe.name
    if recipe not in RECIPES:
        raise ConfigError("recipe", recipe, f"must be one of {', '.join(RECIPES)}")
    data = cfg.data.name
    if recipe in DATA and data != DATA[recipe]:
        raise ConfigError(
            "data",
            data,
            f"recipe={recipe} trains on data={DATA[recipe]} "
            f"({'rows with messages' if recipe == 'sft' else 'rows with prompt, chosen, rejected'})",
        )
    if data in DATA.values():
        wanted = next(r for r, d in DATA.items() if d == data)
        if recipe != wanted:
            raise ConfigError("recipe", recipe, f"data={data} is for recipe={wanted}")
        if cfg.model.name != "hf":
            raise ConfigError(
                "model",
                cfg.model.name,
                f"data={data} tokenizes with the model directory's tokenizer "
                "and chat template: use model=hf model.path=<directory>",
            )
        if not cfg.data.path:
            raise ConfigError(
                "data.path", cfg.data.path, f"data={data} needs a JSONL file, or Parquet files, of its rows"
            )
        c = cfg.data.cache
        if c.endpoints or c.eval_endpoints or c.nodes:
            raise ConfigError(
                "data.cache",
                "set",
                f"data={data} is read from its local corpus; cache nodes serve "
                "token rows of data=stdlib or data=parquet only",
            )
    if cfg.data.packing and data != "chat":
        raise ConfigError("data.packing", True, f"packs conversations of data=chat; data={data} has none to pack")
    if cfg.data.packing and cfg.kernels.name == "triton":
        raise ConfigError(
            "data.packing",
            True,
            "restarts positions per conversation, which the Triton rotary kernel does not take: use kernels=torch",
        )
    if recipe == "dpo":
        beta = cfg.recipe.beta
        if not beta > 0:
            raise ConfigError("recipe.beta", beta, "must be > 0")
