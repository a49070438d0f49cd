"""Expert parallelism (`strategy.ep > 1`, TorchTitan's `expert_parallel_degree`): each mixture-of-experts layer's
experts split over groups of `ep` data-parallel ranks, the tokens sent to their experts by all-to-all.

`dp_shard` is split into (dp_shard_mod_ep, ep), ep the inner part (`ParallelDims.expert_mesh`, TorchTitan's
`dp_shard_in_ep`): rank i of an ep group holds experts [i E / ep, (i + 1) E / ep) under their own indices, so that
a checkpoint names every expert whole, as one process would (DCP reshards it to any other ep, and
`python -m trainer.export` reads it), and FSDP2 shards them over the dp_shard_mod_ep (x dp_replicate) ranks
that hold the same experts. The rest of the block is sharded over all of dp_shard, as without ep.

A layer's step (`ExpertParallel.__call__`): the router runs on the rank's own tokens, as in one process; each
(token, chosen expert) pair is sent to its expert's rank (one all-to-all of the counts, one of the rows), every
local expert runs on the rows it received (possibly none: every parameter takes part in each backward), and the
outputs go back the same way (the reverse all-to-all), to be weighted and summed per token as in one process.
Both all-to-alls are autograd functions whose backward is the reverse all-to-all. Dropless: no capacity limit.

Gradients: FSDP2 averages every gradient over the ranks that reduce it; an expert's gradient already sums the
loss of every rank of its ep group (their tokens reached it), so its backward is scaled by 1 / ep (`_ScaleGrad`
before the return trip, undone for the rows' own gradient after the outbound one): the average over all
data-parallel ranks, as for every other parameter. The load-balancing loss takes the router's statistics summed
over the data-parallel ranks (`summed`, autograd-aware): the loss of the global batch, equal to one process's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from trainer.models.moe import MoE

# A parameter of a rank's own experts carries the process group of its ep ranks under this attribute: their
# squared gradient norms add up over that group (`trainer.parallel.clip_grad_norm_`).
EXPERT_GROUP = "expert_parallel_group"


class _AllToAll(torch.autograd.Function):
    """Rows of `x` sent to the group's ranks (`send[i]` rows to rank i, in order), `receive[i]` rows received from
    rank i; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, receive: list[int], send: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (receive, send), group
        return _all_to_all(x, receive, send, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        receive, send = ctx.splits
        return _all_to_all(grad, send, receive, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, receive: list[int], send: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
    return out


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _AllReduce(torch.autograd.Function):
    """The sum over the group's ranks; the backward sums the gradients too (each rank's loss holds the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ExpertParallel:
    """A rank's dispatch of one model's mixtures of experts: `group` its ep ranks (it is rank `rank` of `size`);
    the router's statistics are summed over `stats_group`, every data-parallel rank (None: the world, as
    `apply` gives it: ep runs with tp = pp = 1, so every rank holds rows of its own)."""

    def __init__(self, group, rank: int, size: int, stats_group=None):
        self.group, self.rank, self.size, self.stats_group = group, rank, size, stats_group

    def local(self, n_experts: int) -> range:
        """The indices of the experts this rank holds, of `n_experts`."""
        per_rank = n_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def __call__(self, moe: MoE, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The layer's output for the rank's tokens `flat` (tokens, dim), routed to `chosen` (tokens, top_k)
        experts with `weights`: the weighted sum of their experts' outputs, as `MoE.forward` computes it."""
        n_experts = moe.gate.out_features
        expert = chosen.reshape(-1)
        token = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(chosen.shape[1])
        order = torch.argsort(expert, stable=True)  # by expert, so by the rank that holds it
        counts = torch.bincount(expert, minlength=n_experts)
        # received[s, j]: the rows rank s sends to this rank's j-th expert
        received = _all_to_all(counts, [n_experts // self.size] * self.size, [n_experts // self.size] * self.size,
                               self.group).view(self.size, -1)
        send = counts.view(self.size, -1).sum(1).tolist()
        receive = received.sum(1).tolist()
        rows = _AllToAll.apply(flat[token[order]], receive, send, self.group)
        out = self._experts(moe, _ScaleGrad.apply(rows, float(self.size)), received)
        out = _AllToAll.apply(_ScaleGrad.apply(out, 1.0 / self.size), send, receive, self.group)
        y = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add(0, token[order], y.to(flat.dtype))

    def _experts(self, moe: MoE, rows: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """Each local expert's output on its rows of `rows` (laid out by sending rank, then by expert), in the
        same layout."""
        local = torch.arange(received.shape[1], device=rows.device).repeat(self.size)
        owner = torch.repeat_interleave(local, received.reshape(-1))
        by_expert = torch.argsort(owner, stable=True)
        chunks = rows[by_expert].split(received.sum(0).tolist())
        outs = [moe.experts[str(index)](chunk) for index, chunk in zip(self.local(moe.gate.out_features), chunks,
                                                                        strict=True)]
        return torch.cat(outs).index_select(0, torch.argsort(by_expert))

    def summed(self, counts: torch.Tensor, prob_sum: torch.Tensor, rows: int):
        """The router's statistics (routed tokens per expert, summed probabilities, rows) summed over the
        data-parallel ranks: those of the global batch."""
        totals = torch.cat([counts.double(), counts.new_tensor([rows], dtype=torch.float64)])  # counts exact
        dist.all_reduce(totals, group=self.stats_group)
        return totals[:-1].to(counts.dtype), _AllReduce.apply(prob_sum, self.stats_group), int(totals[-1])


def apply(model: nn.Module, dims, policy) -> None:
    """Keep this rank's experts of each mixture of `model` (on the meta device) and give the mixture its
    dispatch; under FSDP2 shard them over the ranks that hold the same experts, in mixed precision `policy`."""
    ep = dims.expert_mesh["ep"]
    dispatch = ExpertParallel(ep.get_group(), ep.get_local_rank(), dims.ep)
    names = ("dp_replicate", "dp_shard_mod_ep") if dims.dp_replicate > 1 else ("dp_shard_mod_ep",)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        keep = {str(i) for i in dispatch.local(moe.gate.out_features)}
        for index in [i for i in moe.experts if i not in keep]:
            del moe.experts[index]
        moe.dispatch = dispatch
        fully_shard(list(moe.experts.values()), mesh=dims.expert_mesh[names], mp_policy=policy)


def mark(model: nn.Module) -> None:
    """Tag the parameters of `model`'s local experts with their ep group (once they are on the device)."""
    for moe in (m for m in model.modules() if isinstance(m, MoE) and m.dispatch is not None):
        for param in moe.experts.parameters():
            setattr(param, EXPERT_GROUP, moe.dispatch.group)
