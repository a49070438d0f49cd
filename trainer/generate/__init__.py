"""Sampling from our `Transformer` (a preset, or a `model=hf` model): batched prompts of any lengths, left
padded, decoded token by token through a `KVCache`; greedy or sampled (`trainer.generate.sampling`); each row
stops at one of its end tokens or after `max_new_tokens`. `python -m trainer.generate` is the command line."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainer.generate import sampling
from trainer.models import unwrap
from trainer.models.kv_cache import KVCache


def left_padded(prompts: Sequence[Sequence[int]], pad: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, valid), each (batch, longest prompt): every prompt ends in the last column."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if prompt:
            tokens[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            valid[row, width - len(prompt) :] = True
    return tokens.to(device), valid.to(device)


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: Sequence[int] = (),
             pad: int = 0, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None) -> list[list[int]]:
    """The tokens generated after each prompt (non-empty lists of ids), up to and including the first token
    of `eos`, at most `max_new_tokens`. `pad` fills the left of shorter prompts (any id: padding is masked)."""
    for name, value, allowed in sampling.problems(temperature, top_k, top_p):
        raise ValueError(f"{name}={value}: {allowed}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    inner = unwrap(model)
    width = max(len(p) for p in prompts)
    if width + max_new_tokens > inner.max_seq_len:
        raise ValueError(f"the longest prompt ({width} tokens) plus max_new_tokens={max_new_tokens} exceeds the "
                         f"model's {inner.max_seq_len} positions")
    device = inner.rope_cos.device
    tokens, valid = left_padded(prompts, pad, device)
    cache = KVCache(len(inner.layers), width + max_new_tokens)
    stop = torch.tensor(sorted(set(eos)), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out = []
    cache.append(valid)
    logits = model(tokens, cache=cache)[:, -1]
    for _ in range(max_new_tokens):
        step = sampling.next_token(logits, temperature, top_k, top_p, generator)
        step = torch.where(done, pad, step)
        out.append(step)
        done |= torch.isin(step, stop)
        if bool(done.all()) or len(out) == max_new_tokens:
            break
        cache.append(torch.ones_like(valid[:, :1]))
        logits = model(step[:, None], cache=cache)[:, -1]
    rows = torch.stack(out, dim=1).tolist()
    return [_until_end(row, set(eos)) for row in rows]


def _until_end(row: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(row):
        if token in eos:
            return row[: i + 1]
    return row
