"""`recipe=sft` (`SFT`), and the targets for the loss: the next token everywhere (pretrain), or only where the
next token is the assistant's (sft, from the batch's `loss_mask`); the others are IGNORE, which cross-entropy
skips.

With masks, ranks and micro-batches count different numbers of tokens, so a mean per micro-batch would
weigh tokens unequally. `weights` scales each micro-batch's mean to its share of all the step's counted
tokens, across every rank, so the step's loss (and gradient) is the mean over every counted token: the
same for any world size, strategy and accumulation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.models.chunked import IGNORE
from trainer.recipes.pretrain import Pretrain

__all__ = ["IGNORE", "SFT", "shares", "targets", "weights"]


def targets(batch: dict, tokens: torch.Tensor) -> torch.Tensor:
    """(batch, seq) targets for inputs tokens[:, :-1]."""
    if "loss_mask" not in batch:
        return tokens[:, 1:]
    mask = batch["loss_mask"].to(tokens.device, non_blocking=True)[:, 1:].bool()
    return tokens[:, 1:].masked_fill(~mask, IGNORE)


def weights(chunks: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """For each micro-batch of targets, (its counted tokens) x world / (counted tokens on every rank): the
    factor that turns its mean loss into its part of the global mean (`shares` of the counts)."""
    return shares(torch.stack([(c != IGNORE).sum() for c in chunks]).float())


def shares(counts: torch.Tensor) -> list[torch.Tensor]:
    """For each micro-batch's count of what the step's loss averages over (tokens, pairs), count x world / (the
    count on every rank). Tensor-parallel peers count the same batch, and gradient reduction averages over the
    data-parallel ranks; both cancel in the world size."""
    total = counts.sum()
    if dist.is_initialized():
        dist.all_reduce(total)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return list(counts * world / total)


class SFT(Pretrain):
    """`recipe=sft` on data=chat: the next-token loss on the assistant's tokens only, each counted token weighing
    the same across micro-batches and ranks (`weights`)."""

    def _targets(self, batch: dict, tokens: torch.Tensor) -> torch.Tensor:
        return targets(batch, tokens)

    def _scales(self, chunks: tuple[torch.Tensor, ...]) -> list:
        return weights(chunks)

    def _eval_weight(self, target: torch.Tensor):
        return weights((target,))[0]
