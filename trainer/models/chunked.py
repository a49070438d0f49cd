"""Token losses from the final hidden states with the logits made a chunk of tokens at a time: the one way every
recipe takes per-token log-probabilities, cross-entropies or divergences without the (tokens, vocab) logits.

`chunked(fn, hidden, weight, *per_token)` applies `fn(logits of a chunk, *its rows of per_token)` chunk by chunk
and returns its per-token outputs; its backward recomputes each chunk's logits and backpropagates through `fn`
one chunk at a time, so memory holds one chunk's logits (and their gradient), never the whole. Plain PyTorch: it
runs under any strategy and with kernels=torch, and with kernels=triton the chunk's log-softmax is the Triton
cross-entropy (`ce=ops.cross_entropy`). `token_logps` and `cross_entropy` build on it; recipe=kd's divergence too.

Tensor parallelism: the output matrix arrives split over the vocabulary (a DTensor sharded by rows) and the
hidden states split over the sequence. The hidden states are gathered (a small tensor), each rank takes the logits
of its own vocabulary rows, and the log-softmax is reduced across the tensor-parallel group (the max, the sum of
exponentials and the target's logit: three (tokens,) all-reduces per chunk; Megatron's vocabulary-parallel
cross-entropy; recipe=ppo's entropy one more, of the sum of exp(logit) x logit). The gradient of the hidden
states is then each rank's partial sum, which DTensor reduces."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

IGNORE = -100  # the target of a position no loss counts (cross-entropy's ignore_index)
CHUNK_BYTES = 128 * 2**20  # the float32 logits of one chunk take at most this


def chunk_tokens_for(vocab: int) -> int:
    """The tokens of a chunk whose float32 logits fit `CHUNK_BYTES`."""
    return max(16, CHUNK_BYTES // (4 * max(vocab, 1)))


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk, hidden, weight, *per_token):
        parts = []
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                parts.append(fn(F.linear(hidden[rows], weight), *(t[rows] for t in per_token)))
        if not parts:  # no token: empty outputs of fn's kind
            parts.append(fn(F.linear(hidden, weight), *per_token))
        ctx.fn, ctx.chunk = fn, chunk
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(hidden, weight, *per_token)
        ctx.set_materialize_grads(False)
        return tuple(torch.cat(outs) for outs in zip(*parts, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, *per_token = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        w = weight.detach().requires_grad_(need_w)
        device, enabled, dtype = ctx.autocast
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows].detach().requires_grad_(need_h)
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                outs = ctx.fn(F.linear(h, w), *(t[rows] for t in per_token))
            pairs = [(o, g[rows]) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
            inputs = [t for t in (h, w) if t.requires_grad]
            if not pairs or not inputs:
                continue
            got = list(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True))
            if need_h and got[0] is not None:
                grad_h[rows] = got[0]
            if need_w and got[-1] is not None:
                grad_w += got[-1]
        return (None, None, grad_h, grad_w, *([None] * len(per_token)))


def chunked(fn: Callable[..., tuple[torch.Tensor, ...]], hidden: torch.Tensor, weight: torch.Tensor,
            *per_token: torch.Tensor, chunk_tokens: int | None = None,
            softcap: float | None = None) -> tuple[torch.Tensor, ...]:
    """`fn(logits, *rows)`'s per-token outputs over every token, the logits (chunk, vocab) of `chunk_tokens`
    tokens at a time (default: `chunk_tokens_for` the vocabulary). hidden (tokens, dim), weight (vocab, dim),
    per_token: tensors of `tokens` rows that `fn` reads beside the logits (targets, a teacher's hidden states).
    `fn` returns a tuple of (chunk,)-leading tensors; differentiable in hidden and weight. `softcap`: the logits
    soft-capped first, softcap * tanh(logits / softcap), as a model with a final soft-cap (Gemma 2) makes them."""
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
    if softcap is not None:
        inner = fn

        def fn(logits, *rows):
            return inner(capped(logits, softcap), *rows)

    return _Chunked.apply(fn, chunk, hidden, weight, *per_token)


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The logits soft-capped at `softcap` (None: as they are)."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


class _SumOverRanks(torch.autograd.Function):
    """The sum of every rank's partial in forward; in backward each partial's gradient is the sum's (every rank
    holds the same loss, so the gradient arrives whole on each)."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """The logits in float32 at least (float64 kept)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _logps(logits: torch.Tensor, target: torch.Tensor, ce: Callable = F.cross_entropy) -> tuple[torch.Tensor]:
    return (-ce(_wide(logits), target, reduction="none"),)


def _sharded_logps(logits: torch.Tensor, target: torch.Tensor, group, offset: int, entropy: bool = False
                   ) -> tuple[torch.Tensor, ...]:
    """(log p(target),) from logits split over the vocabulary: this rank holds columns offset.. of each row. With
    `entropy`, (log p(target), the entropy of each row's distribution, no gradient): logZ - sum(p logit), the sum
    of exp(logit - max) logit reduced across the group beside the sum of exponentials."""
    logits = _wide(logits)
    peak = logits.detach().max(-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    exps = torch.exp(logits - peak[:, None])
    total = _SumOverRanks.apply(exps.sum(-1), group)
    local = target - offset
    here = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None]).squeeze(1) * here
    log_z = peak + torch.log(total)
    logps = _SumOverRanks.apply(picked, group) - log_z
    if not entropy:
        return (logps,)
    with torch.no_grad():
        weighted = (exps * logits).sum(-1)
        dist.all_reduce(weighted, group=group)
        return logps, log_z - weighted / total


def _plain(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object, int]:
    """(hidden, weight, the tensor-parallel group the vocabulary is split over or None, this rank's first row)
    as plain tensors: DTensors made local, differentiably (the hidden states' gradient a partial sum per rank
    where the vocabulary is split)."""
    if isinstance(weight, DTensor) and any(isinstance(p, Shard) for p in weight.placements):
        mesh = weight.device_mesh
        if mesh.ndim != 1 or weight.placements[0] != Shard(0):
            raise ValueError(f"the output matrix's placements {weight.placements}: chunked log-probabilities take "
                             "it split by vocabulary rows over one mesh dimension")
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        rows = math.ceil(weight.shape[0] / mesh.size())
        return hidden, weight.to_local(), mesh.get_group(), mesh.get_local_rank() * rows
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    if isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()
    return hidden, weight, None, 0


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int | None = None,
                ce: Callable = F.cross_entropy, softcap: float | None = None) -> torch.Tensor:
    """(batch, seq) log p(target) at each position, 0 where the target is IGNORE; only the counted positions'
    logits are made. hidden (batch, seq, dim), weight (vocab, dim), targets (batch, seq). `ce`: the cross-entropy
    a chunk's log-softmax is taken with (F.cross_entropy, or ops.cross_entropy under kernels=triton)."""
    hidden, weight, group, offset = _plain(hidden, weight)
    if group is None:
        def fn(logits, t):
            return _logps(logits, t, ce)
    else:
        def fn(logits, t):
            return _sharded_logps(logits, t, group, offset)
    return _per_position(fn, hidden, weight, targets, chunk_tokens, softcap)[0]


def _per_position(fn: Callable, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  chunk_tokens: int | None, softcap: float | None) -> tuple[torch.Tensor, ...]:
    """`chunked(fn)`'s outputs over the counted (not IGNORE) targets' positions only, each (batch, seq) with 0
    where the target is IGNORE."""
    counted = (targets != IGNORE).flatten()
    h, y = hidden.flatten(0, 1)[counted], targets.flatten()[counted]
    outs = chunked(fn, h, weight, y, chunk_tokens=chunk_tokens, softcap=softcap)
    return tuple(t.new_zeros(targets.numel()).masked_scatter(counted, t).view(targets.shape) for t in outs)


def cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  chunk_tokens: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The mean next-token cross-entropy over the counted (not IGNORE) targets, as `F.cross_entropy` gives it
    from the whole logits (NaN where nothing is counted)."""
    count = (targets != IGNORE).sum()
    return -token_logps(hidden, weight, targets, chunk_tokens, softcap=softcap).sum() / count


def token_logps_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                        chunk_tokens: int | None = None, ce: Callable = F.cross_entropy,
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """((batch, seq) log p(target), (batch, seq) the entropy of the next-token distribution, no gradient) of the
    logits divided by `temperature` (after the soft-cap), 0 where the target is IGNORE: `token_logps` and the
    entropy from the same chunk of logits (recipe=ppo's policy, as TRL's PPOTrainer scales its logits). With the
    vocabulary split over the tensor-parallel ranks, both from the shards (`_sharded_logps`)."""
    hidden, weight, group, offset = _plain(hidden, weight)
    if group is None:
        def fn(logits, target):
            logits = _wide(logits) / temperature
            with torch.no_grad():
                entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
            return -ce(logits, target, reduction="none"), entropy
    else:
        def fn(logits, target):
            return _sharded_logps(_wide(logits) / temperature, target, group, offset, entropy=True)
    return _per_position(fn, hidden, weight, targets, chunk_tokens, softcap)
