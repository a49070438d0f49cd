"""Choosing the next token from logits: greedy, or sampled at a temperature from the top-k and top-p (nucleus)
tokens, filtered as `transformers`' TopK/TopP logits warpers filter them (temperature, then top-k, then top-p;
ties at the k-th logit are kept; the nucleus is the smallest set of tokens whose probability reaches top_p,
the most likely token always in it)."""

from __future__ import annotations

import torch


def problems(temperature: float, top_k: int, top_p: float) -> list[tuple[str, float, str]]:
    """(setting, value, what is allowed) for each setting out of range; empty when all are fine."""
    found = []
    if not temperature >= 0:
        found.append(("temperature", temperature, "must be >= 0 (0 is greedy)"))
    if top_k < 0:
        found.append(("top_k", top_k, "must be >= 0 (0 keeps every token)"))
    if not 0 < top_p <= 1:
        found.append(("top_p", top_p, "must be in (0, 1] (1 keeps every token)"))
    return found


def filtered(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """`logits` (batch, vocab) divided by `temperature`, -inf outside the top-k and the top-p nucleus."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1:
        ordered, order = torch.sort(scores, dim=-1)  # ascending: the tail first
        tail = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        tail[..., -1] = False
        scores = scores.masked_fill(tail.scatter(-1, order, tail), float("-inf"))
    return scores


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row (batch,): the argmax at temperature 0, else a draw from `filtered` logits."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = filtered(logits, temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
