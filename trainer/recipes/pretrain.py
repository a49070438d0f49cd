"""`recipe=pretrain`: the next-token loss on every token of token rows (data=stdlib, data=parquet, cache
nodes), and the base of recipe=sft and recipe=kd, whose chat rows reach the model as `data.packing` says
(`trainer.data.packing`). A mixture of experts adds
its router's `moe/aux_loss` and `moe/expert_load_max` (the busiest expert's share of the routed tokens, times
the number of experts: 1 when balanced) to each metrics line."""

from __future__ import annotations

import torch

from trainer.data import packing
from trainer.models import unwrap
from trainer.models.chunked import IGNORE
from trainer.recipes.base import Recipe, local


class Pretrain(Recipe):
    def __init__(self, cfg, model, ctx):
        super().__init__(cfg, model, ctx)
        self.packing = packing.choose(cfg.data.packing, ctx.pipeline is not None)

    def _targets(self, batch: dict, tokens: torch.Tensor) -> torch.Tensor:
        return tokens[:, 1:]

    def _scales(self, chunks: tuple[torch.Tensor, ...]) -> list:
        return [1 / len(chunks)] * len(chunks)

    def _collated(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's (tokens, targets, real input positions of each row: every one for token rows), which
        `packing.collate` gives the model as `data.packing` says."""
        tokens = self.tokens(batch)
        target = self._targets(batch, tokens)
        return tokens, target, packing.input_lengths(batch.get("lengths"), *target.shape)

    def micro_batches(self, batch: dict, accum: int) -> list:
        tokens, target, real = self._collated(batch)
        micros = [packing.collate(*parts, self.packing, self.ctx.dims.sequence_multiple)
                  for parts in zip(tokens.chunk(accum), target.chunk(accum), real.chunk(accum), strict=True)]
        chunks = tuple(m.target for m in micros)
        self.count(int(real.sum()), sum((c != IGNORE).sum() for c in chunks))
        return [(m.tokens, m.target, m.documents, scale) for m, scale in zip(micros, self._scales(chunks),
                                                                                strict=True)]

    def _forward(self, tokens: torch.Tensor, target: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        with self.ctx.autocast:
            if documents is not None:  # packed rows (data.packing=padding_free)
                return self.model(tokens[:, :-1], target, documents[:, :-1].to(self.ctx.device))
            return self.model(tokens[:, :-1], target)

    def loss(self, micro) -> torch.Tensor:
        tokens, target, documents, scale = micro
        loss = self._forward(tokens, target, documents) * scale
        moe = unwrap(self.model).__dict__.pop("moe_stats", None)  # a mixture of experts: its router's numbers
        if moe:
            self.add_stats(moe, 1 / self.cfg.train.grad_accum_steps)
        return loss

    def step(self, micro) -> torch.Tensor:
        return self._run(*micro, backward=True)

    def _run(self, tokens: torch.Tensor, target: torch.Tensor, documents: torch.Tensor | None, scale,
             backward: bool) -> torch.Tensor:
        """The one place where the pipeline (strategy.pp > 1) takes the model's place: its schedule runs the
        forward (and with `backward` the backward) of the micro-batch over the stages. The loss x `scale`,
        detached."""
        if self.ctx.pipeline is not None:
            documents = None if documents is None else documents[:, :-1]
            return self.ctx.pipeline.run(tokens[:, :-1], target, documents, scale, backward)
        loss = self.loss((tokens, target, documents, scale))
        if backward:
            self.ctx.backward(loss)
        return local(loss.detach())

    def eval_loss(self, batch: dict) -> torch.Tensor:
        m = packing.collate(*self._collated(batch), self.packing, self.ctx.dims.sequence_multiple)
        with self.ctx.loss_context():
            loss = self._run(m.tokens, m.target, m.documents, 1.0, backward=False)
        return loss * self._eval_weight(m.target)

    def _eval_weight(self, target: torch.Tensor):
        return 1.0

