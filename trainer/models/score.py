"""A sequence-classification head on our `Transformer`, as transformers' *ForSequenceClassification models hold
it: the LM head replaced by `score`, a linear layer of one output and no bias, read at each row's last token that
is not padding (transformers' rule: the rightmost token whose id is not pad_token_id). The head is kept as the
model's `output`, so that every strategy places it as it places an output layer; Hugging Face names it
`score.weight`. recipe=reward trains one; recipe.reward_model.path loads one to score completions."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.models import unwrap


def attach(model: nn.Module) -> nn.Module:
    """`model` (a `Transformer`, on any device, meta included) with a score head instead of its LM head."""
    model.output = nn.Linear(model.dim, 1, bias=False)
    model.tied_output = None
    model.score_head = True
    return model


def has_head(model: nn.Module) -> bool:
    return getattr(unwrap(model), "score_head", False)


def last_tokens(tokens: torch.Tensor, pad: int) -> torch.Tensor:
    """(batch,) the index of each row's rightmost token that is not `pad` (0 for a row of padding only)."""
    index = torch.arange(tokens.shape[1], device=tokens.device)
    return (index * (tokens != pad)).argmax(-1)


def scores(model: nn.Module, tokens: torch.Tensor, pad: int) -> torch.Tensor:
    """(batch,) float32: each row's score, at its last token that is not `pad`."""
    out = model(tokens)
    if isinstance(out, DTensor):
        out = out.full_tensor()
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    return out[rows, last_tokens(tokens, pad), 0].float()
