"""A sequence-classification head on our `Transformer`, as transformers' *ForSequenceClassification models hold
it: the LM head replaced by `score`, a linear layer of one output and no bias, read at each row's last token that
is not padding (transformers' rule: the rightmost token whose id is not pad_token_id), or of rows packed into one
(`data.packing=padding_free`) at each document's. The head is kept as the
model's `output`, so that every strategy places it as it places an output layer; Hugging Face names it
`score.weight`. recipe=reward trains one; recipe.reward_model.path loads one to score completions."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def attach(model: nn.Module) -> nn.Module:
    """`model` (a `Transformer`, on any device, meta included) with a score head instead of its LM head."""
    model.output = nn.Linear(model.dim, 1, bias=False)
    model.tied_output = None
    model.score_head = True
    return model


def attach_value_head(model: nn.Module) -> nn.Module:
    """`model` with a value head beside its LM head (recipe=ppo's recipe.value_model=shared): `value_head`, a linear
    layer of one output and no bias on the final hidden states; the export leaves it out."""
    model.value_head = nn.Linear(model.dim, 1, bias=False)
    return model


def last_tokens(tokens: torch.Tensor, pad: int, documents: torch.Tensor | None = None, count: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) of each sequence's rightmost token that is not `pad` (its first for one of padding only):
    of each row of `tokens` (batch, seq), or with `documents` (1, seq) of each of the `count` documents numbered
    0.. packed into the one row (`trainer.data.packing`; ids from `count` on number filler)."""
    index = torch.arange(tokens.shape[1], device=tokens.device)
    real = torch.where(tokens != pad, index, -1)
    if documents is None:
        return torch.arange(tokens.shape[0], device=tokens.device), real.max(-1).values.clamp(min=0)
    ids = documents[0].clamp(max=count)
    last = real.new_full((count + 1,), -1).scatter_reduce(0, ids, real[0], "amax")
    first = real.new_full((count + 1,), tokens.shape[1]).scatter_reduce(0, ids, index, "amin")
    return index.new_zeros(count), torch.where(last >= 0, last, first)[:count]


def scores(model: nn.Module, tokens: torch.Tensor, pad: int, documents: torch.Tensor | None = None,
           count: int = 0) -> torch.Tensor:
    """float32 scores, each at its sequence's last token that is not `pad`: (batch,) of the rows of `tokens`, or
    with `documents` (`last_tokens`) (count,) of the documents packed into its one row."""
    out = model(tokens) if documents is None else model(tokens, None, documents)
    if isinstance(out, DTensor):
        out = out.full_tensor()
    rows, at = last_tokens(tokens, pad, documents, count)
    return out[rows, at, 0].float()
