"""`recipe.reward_model.path`: a trained reward model (an exported recipe=reward run, or any one-label
*ForSequenceClassification of a family trainjob loads, with the policy's tokenizer) scoring recipe=grpo's and
rloo's completions beside the reward functions. It is placed like the policy (`trainer.parallel.assembly`), frozen,
and reads each completion after its prompt as the policy's token ids, right padded with its config's
pad_token_id, or packed without padding as `data.packing` says (`trainer.data.packing`); its score is read at the
last token that is not padding, as transformers reads it."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from trainer.data import packing
from trainer.models import score
from trainer.models.chunked import IGNORE
from trainer.parallel.assembly import assemble


class RewardModel:
    def __init__(self, cfg, ctx):
        self.path, self.device = cfg.recipe.reward_model.path, ctx.device
        self.multiple = ctx.dims.sequence_multiple  # the rows' widths: tp's sequence split, cp's chunks
        self.packing = packing.choose(cfg.data.packing, False)
        self.name = os.path.basename(os.path.normpath(self.path))  # as TRL names a model's rewards
        with open(os.path.join(self.path, "config.json")) as f:
            pad = json.load(f).get("pad_token_id")
        self.pad = 0 if pad is None else int(pad)
        model_cfg = dataclasses.replace(cfg.model, name="hf", path=self.path)
        self.model = assemble(model_cfg, cfg, ctx.dims, ctx.kernels, peft=False, qat=False, frozen=True,
                              score_head=True)

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """(n,) the score of each completion after its prompt."""
        rows = [p + c for p, c in zip(prompts, completions, strict=True)]
        width = -(-max(len(r) for r in rows) // self.multiple) * self.multiple
        tokens = torch.full((len(rows), width + 1), self.pad, dtype=torch.long)  # the inputs: [:, :-1]
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        target = torch.full((len(rows), width), IGNORE, device=self.device)  # none: the score reads the last token
        micro = packing.collate(tokens.to(self.device), target, torch.tensor([len(r) for r in rows]), self.packing,
                                self.multiple)
        count = 0 if micro.keep is None else len(rows)
        return score.scores(self.model, micro.tokens[:, :-1], self.pad, micro.inputs_documents, count)
