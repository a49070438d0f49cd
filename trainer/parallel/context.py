"""Context parallelism (`strategy.cp`): each row's tokens split over the ranks of the mesh's `cp` dimension, which
read the same rows, so that a row too long for one rank's activations trains over several.

The split is the load-balanced one for causal attention (Llama 3's paper, TorchTitan's): the row is cut into
2 x cp chunks and rank r holds chunks r and 2 cp - 1 - r, its head and its tail, so every rank attends over as
many keys. Each rank runs the model on its own tokens; the rotary tables are read at the tokens' true positions;
attention all-gathers the keys and values of every layer over the cp ranks (one collective of the whole row's
keys and values per layer, exact; its backward is a reduce-scatter of their gradients, through PyTorch's
autograd-aware functional collectives) and each of the rank's two chunks attends to the keys up to its own end.
Where the rows are not packed and the layer has no sliding window, on the CPU, that needs no mask: a chunk reads
the keys before it in full and its own causally, two flash-attention blocks merged by their log-sum-exps
(`GatheredCausalChunks`). Else it attends under a mask of the true positions (causal, within its document for packed
rows, within a sliding window where the layer has one), O(seq^2 / cp) of memory per forward.

The loss: each rank sums its tokens' cross-entropies and divides by the whole row's count of counted targets,
times cp, so that the mean over the cp ranks (the gradients' average, FSDP2 sharding over dp_shard x cp) is the
mean over every token, as one process computes it. Where a recipe reads per-token log-probabilities of its own
(`loss_fn`: dpo) or the logits, the final hidden states are all-gathered back into row order first, and every cp
rank computes the same whole-row result.

The model knows nothing of this: `trainer.parallel.parallelize` sets a `ContextParallel` as the decoder's
`context_parallel`, and the decoder asks it to split, to attend and to share the loss.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from trainer.models.chunked import IGNORE

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def held_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of a row's 2 x cp chunks that `rank` holds: its head and its tail."""
    return rank, 2 * cp - 1 - rank


def split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """`rank`'s share of `x` along `dim` (its length a multiple of 2 x cp): its two chunks, one after the other."""
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[i] for i in held_chunks(cp, rank)], dim)


def spans(seq: int, cp: int, rank: int) -> tuple[tuple[int, int, int, int], ...]:
    """Where `rank`'s two chunks of a row of `seq` tokens are: (first, end) among its own tokens, (start, end) in
    the row."""
    width = seq // (2 * cp)
    return tuple((i * width, (i + 1) * width, chunk * width, (chunk + 1) * width)
                 for i, chunk in enumerate(held_chunks(cp, rank)))


def unsplit(x: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """The row in its order from every rank's share one after another along `dim` (as an all-gather gives them)."""
    chunks = x.chunk(2 * cp, dim)
    slot = {chunk: i for rank in range(cp) for i, chunk in enumerate(held_chunks(cp, rank), start=2 * rank)}
    return torch.cat([chunks[slot[chunk]] for chunk in range(2 * cp)], dim)


class ContextParallel:
    """This rank's place among the cp ranks (`mesh`: the mesh's `cp` dimension) and what the decoder asks of it."""

    def __init__(self, mesh):
        self.group, self.size, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return split(x, self.size, self.rank, dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's share of `x` along `dim`, back in row order; differentiable (a reduce-scatter back)."""
        whole = funcol.all_gather_single_autograd(x.movedim(dim, 0).contiguous(), gather_dim=0, group=self.group)
        return unsplit(funcol.wait_tensor(whole).movedim(0, dim), self.size, dim)

    def whole(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """`gather` outside autograd: every rank's share of `x` along `dim`, in row order."""
        whole = funcol.all_gather_single(x.movedim(dim, 0).contiguous(), gather_dim=0, group=self.group)
        return unsplit(funcol.wait_tensor(whole).movedim(0, dim), self.size, dim)

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of `whole` for gradients: `x` (the whole row along `dim`) summed over the cp ranks, this
        rank's share of the sum (a reduce-scatter)."""
        row = torch.arange(x.shape[dim], device=x.device)
        order = torch.cat([split(row, self.size, rank, dim=0) for rank in range(self.size)])
        ranked = x.movedim(dim, 0).index_select(0, order)  # every rank's share in turn, one copy
        share = funcol.reduce_scatter_single(ranked, "sum", 0, group=self.group)
        return funcol.wait_tensor(share).movedim(0, dim)

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """The true positions in the row of this rank's tokens."""
        return self.split(torch.arange(seq, device=device), dim=0)

    def attention(self, seq: int, documents: torch.Tensor | None, window: int | None,
                  device: torch.device) -> Exchange:
        """The attention of a forward over rows of `seq` tokens (`documents`: the packed rows' document ids)."""
        return Exchange(self, seq, documents, window, device)

    def share(self, summed: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The rank's part of the loss from the sum of its tokens' losses `summed`: over the count of the whole
        row's counted `targets`, times cp (the mean over the cp ranks is then the whole rows' mean)."""
        return summed * self.size / (targets != IGNORE).sum()


class GatheredCausalChunks(torch.autograd.Function):
    """Causal attention of the rank's chunks of a row's queries over the whole row's keys and values, all-gathered
    from the cp ranks' shares `kv` (keys and values stacked, the tokens along dim 3), with no mask made: a chunk
    of queries [start, end) reads the keys before `start` in full and its own keys causally (two flash-attention
    calls of the CPU, `_scaled_dot_product_flash_attention_for_cpu`, which return their log-sum-exps too), the two
    outputs merged exactly by their log-sum-exps (flash and ring attention's merge). The backward runs the flash
    backward of each block with the merged output and log-sum-exp, which makes each block's probabilities the
    row's own and so gives each block's exact share of the gradients (summed). It keeps only the queries, the
    rank's own keys and values, the merged output and its log-sum-exp: the backward gathers the row's keys and
    values again (ring attention's trade: one more all-gather per layer, for not holding every layer's whole keys
    and values until the backward reaches it) and reduce-scatters their gradients back to the ranks. Grouped-query
    attention as the op takes it (fewer key-value heads)."""

    @staticmethod
    def forward(ctx, q, kv, cp: ContextParallel, chunks: tuple[tuple[int, int, int, int], ...],
                scale: float | None):
        out, lse = chunks_forward(q, *cp.whole(kv, dim=3).unbind(0), chunks, scale)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.cp, ctx.chunks, ctx.scale = cp, chunks, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kv, out, lse = ctx.saved_tensors
        whole = ctx.cp.whole(kv, dim=3)
        dq, dkv = chunks_backward(grad, q, whole, out, lse, ctx.chunks, ctx.scale)
        del whole  # before the reduce-scatter's copy
        return dq, ctx.cp.scatter(dkv, dim=3), None, None, None


def chunks_forward(q, k, v, chunks, scale):
    """`GatheredCausalChunks`'s output and its log-sum-exp, of the whole row's keys `k` and values `v`."""
    outs, lses = [], []
    for rows_start, rows_end, start, end in chunks:
        parts = [FLASH(q[:, :, rows_start:rows_end], k[:, :, a:b], v[:, :, a:b], 0.0, causal, scale=scale)
                 for a, b, causal in _blocks(start, end)]
        out, lse = parts[-1]
        if len(parts) == 2:
            (out_before, lse_before), lse = parts[0], torch.logaddexp(parts[0][1], lse)
            out = (out_before.to(lse.dtype) * (lse_before - lse).exp()[..., None]  # lse: at least float32
                   + out.to(lse.dtype) * (parts[1][1] - lse).exp()[..., None]).to(q.dtype)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def chunks_backward(grad, q, kv, out, lse, chunks, scale):
    """`GatheredCausalChunks`'s gradients of the queries and of the whole row's keys and values `kv` (stacked, as
    one buffer): each block's flash backward with the merged output and log-sum-exp, summed."""
    grad, (k, v) = grad.contiguous(), kv.unbind(0)
    dq, dkv = torch.zeros_like(q), torch.zeros_like(kv)
    for rows_start, rows_end, start, end in chunks:
        rows = slice(rows_start, rows_end)
        for a, b, causal in _blocks(start, end):
            gq, gk, gv = FLASH_BACKWARD(grad[:, :, rows], q[:, :, rows], k[:, :, a:b], v[:, :, a:b],
                                        out[:, :, rows], lse[:, :, rows], 0.0, causal, scale=scale)
            dq[:, :, rows] += gq
            dkv[0, :, :, a:b] += gk
            dkv[1, :, :, a:b] += gv
    return dq, dkv


def _blocks(start: int, end: int) -> list[tuple[int, int, bool]]:
    """The keys a chunk of queries [start, end) reads, as (first, end, causal) blocks: those before it, in full
    (none for the row's first chunk), and its own, causally."""
    return [(0, start, False)] * (start > 0) + [(start, end, True)]


class Exchange:
    """The keys and values of each layer all-gathered, and each of this rank's two chunks of queries attending to
    the keys before its end. Rows of one document with no sliding window, on the CPU under PyTorch's attention,
    attend with no mask (`GatheredCausalChunks`, which gathers again in the backward); else under the mask of
    their true positions (made once per forward, for every layer: O(seq^2 / cp) of memory)."""

    def __init__(self, cp: ContextParallel, seq: int, documents: torch.Tensor | None, window: int | None,
                 device: torch.device):
        self.cp, self.documents, self.window, self.device = cp, documents, window, device
        self.parts = spans(seq, cp.size, cp.rank)
        self.additive: dict[torch.dtype, list[torch.Tensor]] = {}

    def masks(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The chunks' masks as additive ones of `dtype` (0 or -inf), made once for every layer: given a boolean
        mask, scaled_dot_product_attention makes such a copy at each call and keeps it for the backward."""
        if dtype not in self.additive:
            self.additive[dtype] = [self._mask(start, end, dtype) for _, _, start, end in self.parts]
        return self.additive[dtype]

    def _mask(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask of the queries [start, end) over the keys before `end`, at their true positions."""
        queries = torch.arange(start, end, device=self.device)[:, None]
        keys = torch.arange(end, device=self.device)[None]
        mask = keys <= queries
        if self.window is not None:
            mask = mask & (queries - keys < self.window)
        if self.documents is not None:
            mask = (mask & (self.documents[:, start:end, None] == self.documents[:, None, :end]))[:, None]
        return torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill_(~mask, float("-inf"))

    def attend(self, fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
        """`fn` (scaled_dot_product_attention's signature) of the rank's queries (batch, heads, its tokens, dim)
        over the whole row's keys and values, gathered from the cp ranks in one collective. The decoder's
        `enable_gqa` is implied by the shapes (the flash op takes fewer key-value heads as they are)."""
        kv = torch.stack((k, v))
        if (fn is F.scaled_dot_product_attention and self.documents is None and self.window is None
                and q.device.type == "cpu"):
            try:
                return GatheredCausalChunks.apply(q, kv, self.cp, self.parts, kw.get("scale"))
            except RuntimeError:  # inputs the CPU's flash attention refuses: the masked attention below
                pass
        k, v = self.cp.gather(kv, dim=3).unbind(0)
        return torch.cat([fn(q[:, :, first:last], k[:, :, :end], v[:, :, :end], attn_mask=mask, is_causal=False,
                             **kw)
                          for (first, last, _, end), mask in zip(self.parts, self.masks(q.dtype), strict=True)], dim=2)
