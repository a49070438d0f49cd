"""The `recipe` section: which loss a run trains with, and the rules that tie it to the data and model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from omegaconf import MISSING

from trainer.errors import ConfigError

RECIPES = ("pretrain", "sft", "dpo", "grpo", "kd")
# The data each recipe trains on, and the recipe each dataset of its own is for.
DATA = {"sft": "chat", "dpo": "preference", "grpo": "prompts"}
DATA_ROWS = {"chat": "rows with messages", "preference": "rows with prompt, chosen, rejected",
             "prompts": "rows with a prompt (text) or messages"}
SCALE_REWARDS = ("group", "batch", "none")
KD_LOSSES = ("forward_kl", "reverse_kl", "jsd")


@dataclass
class TeacherConfig:
    path: str | None = None  # kd: the teacher's Hugging Face directory (the student's tokenizer)


@dataclass
class KDConfig:
    # forward_kl: KL(teacher || student); reverse_kl: KL(student || teacher); jsd: the Jensen-Shannon divergence
    # (GKD's beta = 0.5), each at `temperature` and scaled by its square (Hinton et al.).
    loss: str = "forward_kl"
    temperature: float = 1.0
    alpha: float = 0.5  # the loss is alpha x the divergence + (1 - alpha) x the student's cross-entropy
    chunk_tokens: int = 1024  # tokens whose logits of both models are held at once


@dataclass
class RecipeConfig:
    # pretrain: next-token loss on every token; sft: only on the assistant's tokens of data=chat;
    # dpo: Direct Preference Optimization on data=preference against the frozen starting model;
    # grpo: Group Relative Policy Optimization on data=prompts with reward functions;
    # kd: knowledge distillation from recipe.teacher on any data.
    name: str = MISSING
    # dpo: how far from the reference the policy may move (the KL penalty's inverse weight); grpo: the KL
    # penalty's weight (0: no reference is held).
    beta: float = 0.1
    # grpo: completions per prompt (train.global_batch_size counts completions), the reward functions
    # (`package.module:function`, called with prompts=, completions= and the rows' other columns, returning a
    # float per completion) and their weights (null: 1 each), how advantages are scaled (group: by each
    # prompt's std; batch: the batch's; none), the clipping range (epsilon_high null: epsilon), the updates per
    # generation batch, and how completions are sampled.
    num_generations: int = 8
    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None
    scale_rewards: str = "group"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    max_completion_length: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    kd: KDConfig = field(default_factory=KDConfig)


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
            f"recipe={recipe} trains on data={DATA[recipe]} ({DATA_ROWS[DATA[recipe]]})",
        )
    if data in DATA.values():
        wanted = next(r for r, d in DATA.items() if d == data)
        if recipe != wanted and not (recipe == "kd" and data == "chat"):
            raise ConfigError("recipe", recipe, f"data={data} is for recipe={wanted}"
                              + (" (or recipe=kd)" if data == "chat" else ""))
        if cfg.model.name != "hf" and data != "prompts":
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
    if recipe == "dpo":
        beta = cfg.recipe.beta
        if not beta > 0:
            raise ConfigError("recipe.beta", beta, "must be > 0")
    if recipe == "grpo":
        _check_grpo(cfg)
    if recipe == "kd":
        _check_kd(cfg)


def _check_grpo(cfg) -> None:
    r, t = cfg.recipe, cfg.train
    if r.num_generations < 2:
        raise ConfigError("recipe.num_generations", r.num_generations, "must be >= 2 (advantages compare the "
                          "completions of one prompt)")
    if t.global_batch_size % r.num_generations:
        raise ConfigError("recipe.num_generations", r.num_generations, f"must divide train.global_batch_size="
                          f"{t.global_batch_size} (which counts completions: num_generations of each prompt)")
    if r.scale_rewards not in SCALE_REWARDS:
        raise ConfigError("recipe.scale_rewards", r.scale_rewards, f"must be one of {', '.join(SCALE_REWARDS)}")
    if not r.reward_funcs:
        raise ConfigError("recipe.reward_funcs", list(r.reward_funcs), "recipe=grpo needs at least one reward "
                          "function, as package.module:function")
    from trainer.recipes import rewards  # imports the user's modules; no torch

    for spec in r.reward_funcs:
        rewards.load(spec)
    if r.reward_weights is not None and len(r.reward_weights) != len(r.reward_funcs):
        raise ConfigError("recipe.reward_weights", list(r.reward_weights), f"must give one weight per reward "
                          f"function ({len(r.reward_funcs)}), or be null for 1 each")
    for key in ("epsilon", "num_iterations", "max_completion_length"):
        if not getattr(r, key) > 0:
            raise ConfigError(f"recipe.{key}", getattr(r, key), "must be > 0")
    if r.epsilon_high is not None and not r.epsilon_high > 0:
        raise ConfigError("recipe.epsilon_high", r.epsilon_high, "must be > 0, or null for recipe.epsilon")
    if not r.beta >= 0:
        raise ConfigError("recipe.beta", r.beta, "must be >= 0 (0: no KL penalty, no reference held)")
    if not r.temperature > 0 or r.top_k < 0 or not 0 < r.top_p <= 1:
        key, value = next((k, getattr(r, k)) for k, ok in (("temperature", r.temperature > 0), ("top_k", r.top_k >= 0),
                                                             ("top_p", 0 < r.top_p <= 1)) if not ok)
        raise ConfigError(f"recipe.{key}", value, "must be > 0 (GRPO samples)" if key == "temperature" else
                          "must be >= 0 (0: every token)" if key == "top_k" else "must be in (0, 1]")
    if cfg.data.seq_len + r.max_completion_length > cfg.model.max_seq_len:
        raise ConfigError("recipe.max_completion_length", r.max_completion_length, f"data.seq_len="
                          f"{cfg.data.seq_len} (the longest prompt) plus this must be <= model.max_seq_len="
                          f"{cfg.model.max_seq_len}")


def _check_kd(cfg) -> None:
    r = cfg.recipe
    if r.kd.loss not in KD_LOSSES:
        raise ConfigError("recipe.kd.loss", r.kd.loss, f"must be one of {', '.join(KD_LOSSES)}")
    if not r.kd.temperature > 0:
        raise ConfigError("recipe.kd.temperature", r.kd.temperature, "must be > 0")
    if not 0 <= r.kd.alpha <= 1:
        raise ConfigError("recipe.kd.alpha", r.kd.alpha, "must be in [0, 1]")
    if not r.kd.chunk_tokens > 0:
        raise ConfigError("recipe.kd.chunk_tokens", r.kd.chunk_tokens, "must be > 0")
    path = r.teacher.path
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("recipe.teacher.path", path, "recipe=kd needs the teacher's Hugging Face model directory "
                          "(holding config.json)")
    from trainer.models import hf  # reads config.json only

    hf.read_config(path, key="recipe.teacher.path")  # a directory trainjob can load, or refused naming the key
    teacher = hf.settings(path)
    if teacher["vocab_size"] != cfg.model.vocab_size:
        raise ConfigError("recipe.teacher.path", path, f"the teacher has a vocabulary of {teacher['vocab_size']} "
                          f"tokens, the student model.vocab_size={cfg.model.vocab_size}: distillation compares "
                          "their distributions token by token, so both need the same tokenizer")
    mine = os.path.join(cfg.model.path, "tokenizer.json") if cfg.model.name == "hf" else None
    theirs = os.path.join(path, "tokenizer.json")
    if mine and os.path.isfile(mine) and os.path.isfile(theirs) and _vocab(mine) != _vocab(theirs):
        raise ConfigError("recipe.teacher.path", path, f"its tokenizer.json maps tokens to other ids than "
                          f"model.path={cfg.model.path}'s: distillation needs the same tokenizer")
    if teacher["max_seq_len"] < cfg.data.seq_len:
        raise ConfigError("recipe.teacher.path", path, f"the teacher holds {teacher['max_seq_len']} positions, "
                          f"fewer than data.seq_len={cfg.data.seq_len}")


def _vocab(tokenizer_json: str) -> dict:
    import json

    with open(tokenizer_json) as f:
        model = json.load(f).get("model", {})
    return model.get("vocab", {})
