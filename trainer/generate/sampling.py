"""Choosing the next token from logits: greedy, or sampled from logits filtered as `transformers`' logits warpers
filter them, in their order (temperature, then top-k, then top-p, then min-p; ties at the k-th logit are kept; the
nucleus is the smallest set of tokens whose probability reaches top_p, the most likely token always in it; min-p
drops the tokens less likely than min_p times the most likely one).

A draw is `torch.multinomial(probs, 1)` as `transformers`' `generate` takes it, written out (an argmax of the
probabilities over exponential noise, the very computation of multinomial's one-sample path) so that a batch whose
ended rows have left still draws the noise of the whole batch: with the same seed, every row gets the token it gets
when all rows stay, as in `transformers`."""

from __future__ import annotations

import torch


def problems(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> list[tuple[str, float, str]]:
    """(setting, value, what is allowed) for each setting out of range; empty when all are fine."""
    found = []
    if not temperature >= 0:
        found.append(("temperature", temperature, "must be >= 0 (0 is greedy)"))
    if top_k < 0:
        found.append(("top_k", top_k, "must be >= 0 (0 keeps every token)"))
    if not 0 < top_p <= 1:
        found.append(("top_p", top_p, "must be in (0, 1] (1 keeps every token)"))
    if not 0 <= min_p <= 1:
        found.append(("min_p", min_p, "must be in [0, 1] (0 keeps every token)"))
    return found


def filtered(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> torch.Tensor:
    """`logits` (batch, vocab) in float32 divided by `temperature`, -inf outside the top-k, the top-p nucleus and
    the min-p set."""
    scores = logits.float()
    if temperature != 1:
        scores = scores / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1:
        ordered, order = torch.sort(scores, dim=-1)  # ascending: the tail first
        tail = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        tail[..., -1] = False
        scores = scores.masked_fill(tail.scatter(-1, order, tail), float("-inf"))
    if min_p > 0:
        probs = scores.softmax(-1)
        below = probs < min_p * probs.amax(-1, keepdim=True)
        below.scatter_(-1, probs.argmax(-1, keepdim=True), False)
        scores = scores.masked_fill(below, float("-inf"))
    return scores


def draw(probs: torch.Tensor, generator: torch.Generator | None = None, rows: torch.Tensor | None = None,
         batch: int | None = None) -> torch.Tensor:
    """One token of each row of `probs` (n, vocab), drawn as `torch.multinomial(full, 1)` draws it for the rows
    `rows` (n,) of a batch of `batch` rows (None: `probs` is the whole batch)."""
    shape = (probs.shape[0] if batch is None else batch, probs.shape[-1])
    noise = torch.empty(shape, dtype=probs.dtype, device=probs.device).exponential_(1, generator=generator)
    return (probs / (noise if rows is None else noise[rows])).argmax(-1)


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generator: torch.Generator | None = None, min_p: float = 0.0, rows: torch.Tensor | None = None,
               batch: int | None = None) -> torch.Tensor:
    """The next token of each row (n,): the argmax at temperature 0, else a draw (`draw`, for the rows `rows` of a
    batch of `batch`) from the `filtered` logits."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = filtered(logits, temperature, top_k, top_p, min_p).softmax(-1)
    return draw(probs, generator, rows, batch)
