"""`recipe=reward`: a reward model as TRL's RewardTrainer trains one, on data=preference. The policy's LM head
becomes a score head (`trainer.models.score`: one output, read at each sequence's last token that is not
padding); with r_c and r_r the scores of a pair's chosen and rejected conversations, the Bradley-Terry loss

    loss = -mean(log sigmoid(r_c - r_r)) + center_rewards_coefficient * mean((r_c + r_r)^2)

(the second term only with recipe.center_rewards_coefficient set, as TRL's, keeping the scores centred on 0).
Metrics as TRL names them: accuracy (the share of pairs scored the right way round), margin (mean r_c - r_r),
min_reward, mean_reward, max_reward; an eval adds eval_accuracy. `python -m trainer.export` writes it as a
*ForSequenceClassification directory that `transformers.AutoModelForSequenceClassification` loads with the same
scores, and that recipe.reward_model.path takes. The conversations reach the model as `data.packing` says
(`trainer.data.packing`; padding_free: each a document of one packed row, scored at its own last token)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.data import packing
from trainer.data.chat import padding_id
from trainer.data.hf_tokenizer import HFTokenizer
from trainer.models import score
from trainer.models.chunked import IGNORE
from trainer.observability import metrics
from trainer.recipes.base import Recipe

METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, center_rewards_coefficient: float | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Bradley-Terry loss of a batch of pairs' scores (each (pairs,)) and its statistics."""
    loss = -F.logsigmoid(chosen - rejected).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
    both = torch.cat([chosen, rejected]).detach()
    stats = {"accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean(),
             "min_reward": both.min(), "mean_reward": both.mean(), "max_reward": both.max()}
    return loss, {k: v.detach() for k, v in stats.items()}


def collate_pairs(tokens: torch.Tensor, lengths: torch.Tensor | None, pad: int, way: str, multiple: int = 1
                  ) -> packing.Packed:
    """A micro-batch of preference rows (with their two real lengths each): the chosen conversations, then the
    rejected ones, each whole (no next-token target: the score reads the last token), collated as `way` (a
    `data.packing`) says."""
    half = tokens.shape[1] // 2  # a row: the chosen conversation, then the rejected one
    rows = F.pad(torch.cat([tokens[:, :half], tokens[:, half:]]), (0, 1), value=pad)  # the inputs are [:, :-1]
    target = torch.full_like(rows[:, 1:], IGNORE)
    real = packing.input_lengths(None if lengths is None else torch.cat([lengths[:, 0], lengths[:, 1]]),
                                 *target.shape)
    return packing.collate(rows, target, real, way, multiple)


def pair_scores(model, micro: packing.Packed, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and the rejected conversations' scores of a micro-batch (`collate_pairs`)."""
    count = 0 if micro.keep is None else micro.keep.shape[0]
    return score.scores(model, micro.tokens[:, :-1], pad, micro.inputs_documents, count).chunk(2)


class Reward(Recipe):
    def __init__(self, cfg, model, ctx):
        super().__init__(cfg, model, ctx)
        self.pad = padding_id(HFTokenizer(cfg.model.path))  # what the preference rows are padded with
        self.packing = packing.choose(cfg.data.packing, ctx.pipeline is not None)
        self.eval_pairs = torch.zeros(2, device=ctx.device)  # pairs scored right, pairs, since the last line

    def _micro(self, tokens: torch.Tensor, lengths: torch.Tensor | None) -> packing.Packed:
        return collate_pairs(tokens, lengths, self.pad, self.packing, self.ctx.dims.tp)

    def _loss(self, micro: packing.Packed) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self.ctx.autocast:
            chosen, rejected = pair_scores(self.model, micro, self.pad)
        return reward_loss(chosen, rejected, self.cfg.recipe.center_rewards_coefficient)

    def micro_batches(self, batch: dict, accum: int) -> list:
        tokens, lengths = self.tokens(batch), batch.get("lengths")
        real = int(lengths.sum()) if lengths is not None else tokens.numel()
        self.count(real, real)  # every real token reaches the score
        return [self._micro(t, n) for t, n in zip(tokens.chunk(accum), lengths.chunk(accum) if lengths is not None
                                                   else [None] * accum, strict=True)]

    def loss(self, micro) -> torch.Tensor:
        loss, stats = self._loss(micro)
        accum = self.cfg.train.grad_accum_steps
        self.add_stats(stats, 1 / accum)
        return loss / accum

    def eval_loss(self, batch: dict) -> torch.Tensor:
        loss, stats = self._loss(self._micro(self.tokens(batch), batch.get("lengths")))
        pairs = batch["tokens"].shape[0]
        self.eval_pairs += torch.stack([stats["accuracy"] * pairs, torch.tensor(float(pairs), device=loss.device)])
        return loss.detach()

    def record(self, steps: int) -> dict[str, float]:
        record = super().record(steps)
        if self.eval_pairs[1] > 0:  # an eval ran since the last line (on every rank alike)
            right, pairs = (metrics.mean_across_ranks(v) for v in self.eval_pairs)
            record["eval_accuracy"] = right / pairs
            self.eval_pairs.zero_()
        return record
