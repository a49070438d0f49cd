"""Context parallelism (`strategy.cp`): each row's tokens split over the ranks of the mesh's `cp` dimension, which
read the same rows, so that a row too long for one rank's activations trains over several.

The split is the load-balanced one for causal attention (Llama 3's paper, TorchTitan's): the row is cut into
2 x cp chunks and rank r holds chunks r and 2 cp - 1 - r, its head and its tail, so every rank attends over as
many keys. Each rank runs the model on its own tokens; the rotary tables are read at the tokens' true positions;
attention all-gathers the keys and values of every layer over the cp ranks (one collective of the whole row's
keys and values per layer, exact; its backward is a reduce-scatter of their gradients, through PyTorch's
autograd-aware functional collectives) and each of the rank's two chunks attends to the keys up to its own end,
under a mask of the true positions (causal, within its document for packed rows, within a sliding window
where the layer has one).

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

from trainer.models.chunked import IGNORE


def held_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of a row's 2 x cp chunks that `rank` holds: its head and its tail."""
    return rank, 2 * cp - 1 - rank


def split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """`rank`'s share of `x` along `dim` (its length a multiple of 2 x cp): its two chunks, one after the other."""
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[i] for i in held_chunks(cp, rank)], dim)


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


class Exchange:
    """The keys and values of each layer all-gathered, and each of this rank's two chunks of queries attending to
    the keys before its end, under the mask of their true positions (made once per forward, for every layer)."""

    def __init__(self, cp: ContextParallel, seq: int, documents: torch.Tensor | None, window: int | None,
                 device: torch.device):
        self.cp = cp
        width = seq // (2 * cp.size)
        self.parts = []  # (the chunk's queries among the rank's, the keys it reads, the mask)
        for i, chunk in enumerate(held_chunks(cp.size, cp.rank)):
            start, end = chunk * width, (chunk + 1) * width
            queries, keys = torch.arange(start, end, device=device)[:, None], torch.arange(end, device=device)[None]
            mask = keys <= queries
            if window is not None:
                mask = mask & (queries - keys < window)
            if documents is not None:
                mask = (mask & (documents[:, start:end, None] == documents[:, None, :end]))[:, None]
            self.parts.append((slice(i * width, (i + 1) * width), end, mask))
        self.additive: dict[torch.dtype, list[torch.Tensor]] = {}

    def masks(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The chunks' masks as additive ones of `dtype` (0 or -inf), made once for every layer: given a boolean
        mask, scaled_dot_product_attention makes such a copy at each call and keeps it for the backward."""
        if dtype not in self.additive:
            self.additive[dtype] = [torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf")) for _, _, mask in self.parts]
        return self.additive[dtype]

    def attend(self, fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
        """`fn` (scaled_dot_product_attention's signature) of the rank's queries (batch, heads, its tokens, dim)
        over the whole row's keys and values, gathered from the cp ranks in one collective."""
        k, v = self.cp.gather(torch.stack((k, v)), dim=3).unbind(0)
        return torch.cat([fn(q[:, :, rows], k[:, :, :end], v[:, :, :end], attn_mask=mask, is_causal=False, **kw)
                          for (rows, end, _), mask in zip(self.parts, self.masks(q.dtype), strict=True)], dim=2)
