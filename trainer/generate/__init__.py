"""Sampling from our `Transformer` (a preset, or a `model=hf` model): batched prompts of any lengths, left
padded, decoded token by token through a `KVCache`; greedy or sampled (`trainer.generate.sampling`); each row
stops at one of its end tokens or after `max_new_tokens`, and leaves the batch then (ended rows leave together
once they are a quarter of the batch): the rows still running move to the front of the cache, allocated once per
call, and every later step computes only them. Sampling still draws the whole batch's random numbers, so a seed
gives the tokens `transformers`' `generate` gives (whose ended rows stay). `python -m trainer.generate` is the
command line.

Under a strategy each rank generates for its own prompts: a DDP model decodes with its inner module (no
collective); a sharded one (FSDP2, TP: DTensor parameters) makes every forward collective, so every rank
steps until all ranks' rows have ended (one all-reduce per token; ended rows stay in the batch), and ranks of a
tensor-parallel group must be given the same prompts (and, when sampling, the same generator seed). Tensor
parallelism splits the sequence of the norms' inputs evenly over its ranks, so there every call's tokens are left
padded to a multiple of the tensor-parallel degree (one new token becomes `tp` columns, all but the last masked)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.generate import sampling
from trainer.generate.packed_weights import packed_linears
from trainer.models import chunked, unwrap
from trainer.models.kv_cache import KVCache


def left_padded(prompts: Sequence[Sequence[int]], pad: int, device=None, multiple: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, valid), each (batch, the longest prompt rounded up to `multiple`): every prompt ends in the last
    column."""
    width = -(-max(len(p) for p in prompts) // multiple) * multiple
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
             generator: torch.Generator | None = None, min_p: float = 0.0) -> list[list[int]]:
    """The tokens generated after each prompt (non-empty lists of ids), up to and including the first token
    of `eos`, at most `max_new_tokens`. `pad` fills the left of shorter prompts (any id: padding is masked)."""
    for name, value, allowed in sampling.problems(temperature, top_k, top_p, min_p):
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
    device = next(inner.parameters()).device
    collective = any(isinstance(p, DTensor) for p in inner.parameters())
    tp = _tp_degree(inner)
    cache = KVCache(len(inner.layers), -(-width // tp) * tp + max_new_tokens * tp)
    # Unsharded, the call runs in inference mode (no version counters nor autograd metadata: ~8% of a CPU decode
    # step); a sharded model's collectives write into its own tensors, and stay under no_grad.
    with torch.inference_mode(not collective), packed_linears(inner, len(prompts)):
        logits = _prefill(inner, prompts, pad, cache, tp, packed=not collective and _packs(inner))
        # Which ids end a row, looked up by id (an isin against the list costs ~20 us a step); an id outside the
        # logits' vocabulary is never generated.
        ending = [t for t in set(eos) if 0 <= t < logits.shape[-1]]
        stop = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device) if ending else None
        if stop is not None:
            stop[ending] = True
        out = torch.full((len(prompts), max_new_tokens), pad, dtype=torch.long, device=device)
        running = torch.arange(len(prompts), device=device)  # the prompt of each row still in the batch
        done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        for i in range(max_new_tokens):
            step = sampling.next_token(logits, temperature, top_k, top_p, generator, min_p, running, len(prompts))
            ends = stop[step] if stop is not None else None  # looked up before `pad` (any id) fills ended rows
            step = torch.where(done, pad, step)
            out[running, i] = step
            if ends is not None:
                done |= ends
            if i == max_new_tokens - 1:
                break
            ended = _ended(done, collective)  # one look at the device a step
            if ended is None:
                break
            # Ended rows leave the batch and its cache once they are a quarter of it (each move copies the cache);
            # under a collective forward (every rank steps until all have ended) they stay, writing padding.
            if not collective and 4 * ended >= len(done):
                kept = (~done).nonzero().squeeze(1)
                running, step, done = running[kept], step[kept], done[kept]
                cache.keep(kept)
            new, new_valid = _next_columns(step, pad, tp)
            cache.append(new_valid)
            logits = _last_logits(inner, new, cache)
    return [_until_end(row, set(eos)) for row in out.tolist()]


def _packs(model: nn.Module) -> bool:
    """Whether the prompts' prefill runs packed (`_prefill`): our decoder, unsharded, whose attention goes
    document by document (no sliding window nor soft-capped scores, which read a mask over the whole row)."""
    return (hasattr(model, "tied_output") and model.options.sliding_window is None
            and model.options.attn_softcap is None)


def _prefill(model: nn.Module, prompts: Sequence[Sequence[int]], pad: int, cache: KVCache, tp: int,
             packed: bool) -> torch.Tensor:
    """Run the prompts into `cache` and give the logits after each, (batch, vocab). `packed`: the distinct
    prompts one after another in one row, no padding computed (GRPO's generations of a prompt share it);
    else left padded (to a multiple of `tp`)."""
    device = next(model.parameters()).device
    if not packed:
        tokens, valid = left_padded(prompts, pad, device, multiple=tp)
        cache.append(valid)
        return _last_logits(model, tokens, cache)
    distinct: dict[tuple[int, ...], int] = {}
    owners = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=device)
    lengths = [len(p) for p in distinct]
    cache.append_packed(lengths, max(lengths), owners)
    tokens = torch.tensor([t for p in distinct for t in p], dtype=torch.long, device=device)[None]
    ends = torch.tensor(lengths, device=device).cumsum(0) - 1
    h = model.hidden_states(tokens, cache=cache)[0, ends]
    out = model.output(h) if model.output is not None else model.tied_output(h, model.tok_embeddings.weight)
    return chunked.capped(out, model.final_softcap)[owners]


def _ended(done: torch.Tensor, collective: bool) -> int | None:
    """How many of this rank's rows have ended, or None when every row has (with `collective`: every rank's)."""
    if collective:
        running = (~done).sum().to(torch.int64)
        dist.all_reduce(running)
        return None if int(running) == 0 else 0
    ended = int(done.sum())
    return None if ended == len(done) else ended


def _next_columns(step: torch.Tensor, pad: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of the next call and which are real: one column, or `tp` columns whose last is the token."""
    if tp == 1:
        return step[:, None], torch.ones(step.shape[0], 1, dtype=torch.bool, device=step.device)
    tokens = torch.full((step.shape[0], tp), pad, dtype=torch.long, device=step.device)
    tokens[:, -1] = step
    valid = torch.zeros(step.shape[0], tp, dtype=torch.bool, device=step.device)
    valid[:, -1] = True
    return tokens, valid


def _tp_degree(model: nn.Module) -> int:
    """The tensor-parallel degree the model's parameters are split over (1 without tensor parallelism)."""
    for p in model.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            return p.device_mesh["tp"].size()
    return 1


def _last_logits(model: nn.Module, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The logits of the last column, (batch, vocab); unsharded, only that column goes through the output layer
    (a prompt's whole logits would be the prefill's largest tensor)."""
    own = hasattr(model, "tied_output")  # our decoder (model.impl=transformers runs its whole forward)
    if own and tokens.shape[1] > 1 and not isinstance(model.tok_embeddings.weight, DTensor):
        h = model.hidden_states(tokens, cache=cache)[:, -1:]
        out = model.output(h) if model.output is not None else model.tied_output(h, model.tok_embeddings.weight)
        return chunked.capped(out[:, -1], model.final_softcap)
    logits = model(tokens, cache=cache)[:, -1]
    # Under tensor parallelism with loss parallelism the logits are split over the vocabulary.
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _until_end(row: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(row):
        if token in eos:
            return row[: i + 1]
    return row
