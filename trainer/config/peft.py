"""The `peft` section: parameter-efficient fine-tuning (`peft=none|lora`). That LoRA needs a pretrained model
is a cross-section rule (`trainer.config.across`)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from trainer.config.checks import one_of, read_by, require

METHODS = ("none", "lora")
# Hugging Face's module names, as PEFT's `target_modules` spells them.
# Which of them a model has is its family's (`trainer.config.families`, `Family.lora_targets`: Phi-3's fused
# qkv_proj and gate_up_proj; only the attention's in a mixture of experts).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


@dataclass
class PeftConfig:
    name: str = MISSING  # the option chosen: none or lora
    rank: int = read_by("lora", default=8)  # the rank of each adapter's low-rank update
    alpha: float = read_by("lora", default=16.0)  # the update is scaled by alpha / rank
    dropout: float = read_by("lora", default=0.0)  # on the adapters' input, while training
    # The projections that get adapters, by Hugging Face's names.
    target_modules: list[str] = read_by("lora", default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def check(self) -> None:
        one_of("peft", self.name, METHODS)
        if self.name == "none":
            return
        require(self.rank > 0, "peft.rank", self.rank, "must be > 0")
        require(self.alpha > 0, "peft.alpha", self.alpha, "must be > 0")
        require(0 <= self.dropout < 1, "peft.dropout", self.dropout, "must be in [0, 1)")
        targets = list(self.target_modules)
        # Which names the model has is a cross-section rule (trainer.config.across: native takes TARGETS).
        require(bool(targets) and all(str(t).isidentifier() for t in targets) and len(set(targets)) == len(targets),
                "peft.target_modules", targets, f"must be distinct module names, such as {', '.join(TARGETS)}")
