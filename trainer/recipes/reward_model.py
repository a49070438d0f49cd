"""`recipe.reward_model.path`: a trained reward model (an exported recipe=reward run, or any one-label
*ForSequenceClassification of a family trainjob loads, with the policy's tokenizer) scoring recipe=grpo's and
rloo's completions beside the reward functions. It is placed like the policy (`trainer.assembly`), frozen,
and reads each completion after its prompt as the policy's token ids, right padded with its config's
pad_token_id; its score is read at the last token that is not padding, as transformers reads it."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from trainer.assembly import assemble
from trainer.models import score


class RewardModel:
    def __init__(self, cfg, ctx):
        self.path, self.device = cfg.recipe.reward_model.path, ctx.device
        self.name = os.path.basename(os.path.normpath(self.path))  # as TRL names a model's rewards
        with open(os.path.join(self.path, "config.json")) as f:
            pad = json.load(f).get("pad_token_id")
        self.pad = 0 if pad is None else int(pad)
        model_cfg = dataclasses.replace(cfg.model, name="hf", path=self.path)
        self.model = assemble(model_cfg, cfg, ctx.dims, peft=False, qat=False, frozen=True, score_head=True)

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """(n,) the score of each completion after its prompt."""
        rows = [p + c for p, c in zip(prompts, completions, strict=True)]
        tokens = torch.full((len(rows), max(len(r) for r in rows)), self.pad, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        return score.scores(self.model, tokens.to(self.device), self.pad)
