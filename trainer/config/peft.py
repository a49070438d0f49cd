"""The `peft` section: parameter-efficient fine-tuning (`peft=none|lora`), its schema and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from trainer.config.errors import ConfigError

METHODS = ("none", "lora")
# Hugging Face's module names, as PEFT's `target_modules` spells them.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class PeftConfig:
    name: str = MISSING
    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input, while training
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


def check(cfg) -> None:
    """Raise ConfigError when the peft section cannot run with the rest of `cfg` (the typed config)."""
    p = cfg.peft
    name = p.name
    if name not in METHODS:
        raise ConfigError("peft", name, f"must be one of {', '.join(METHODS)}")
    if name == "none":
        return
    if cfg.model.name != "hf":
        raise ConfigError(
            "peft",
            name,
            f"LoRA adapts a pretrained model: use model=hf model.path=<directory> "
            f"(model is {cfg.model.name}, whose frozen weights would be random)",
        )
    if p.rank <= 0:
        raise ConfigError("peft.rank", p.rank, "must be > 0")
    if p.alpha <= 0:
        raise ConfigError("peft.alpha", p.alpha, "must be > 0")
    if not 0 <= p.dropout < 1:
        raise ConfigError("peft.dropout", p.dropout, "must be in [0, 1)")
    targets = list(p.target_modules)
    if not targets or any(t not in TARGETS for t in targets) or len(set(targets)) != len(targets):
        raise ConfigError("peft.target_modules", targets, f"must be distinct names among {', '.join(TARGETS)}")
