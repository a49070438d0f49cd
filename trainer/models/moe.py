"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral): a router picks the top-k experts of each token; their gated
MLPs' outputs, weighted by the router's probabilities (renormalised to sum to 1 where `norm_topk_prob`), are
summed. `load_balancing` is transformers' `load_balancing_loss_func` (Switch Transformer's auxiliary loss) over
every MoE layer's router logits of the last forward.

Every expert runs on every step, on the tokens routed to it (possibly none), so that every parameter takes part
in each backward: DDP expects that, and tensor-parallel ranks, which route the same tokens, call the same
collectives. FSDP2 shards the experts with the rest of their block. Under expert parallelism (strategy.ep > 1) a
rank holds some of the experts, under their own indices, and its `dispatch` (`trainer.parallel.expert_parallel`)
runs them: the tokens go to the ranks of their experts and come back, and the router's statistics of the
loss are summed over the data-parallel ranks, so that the loss is the one of their rows in one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    def __init__(self, dim: int, experts: list[nn.Module], top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(dim, len(experts), bias=False)
        self.experts = nn.ModuleDict({str(i): e for i, e in enumerate(experts)})
        self.router_logits: torch.Tensor | None = None  # (tokens, experts) of the last forward
        # strategy.ep > 1: runs the experts of the routed tokens over the expert-parallel ranks (None: here)
        self.dispatch = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.router_logits = logits
        if self.dispatch is not None:
            return self.dispatch(self, flat, weights, chosen).reshape(x.shape)
        out = torch.zeros_like(flat)
        for index, expert in self.experts.items():
            token, slot = torch.where(chosen == int(index))
            y = expert(flat[token]) * weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return out.reshape(x.shape)


def load_balancing(layers: list[MoE]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the load-balancing loss, each expert's share of the routed tokens times the expert count, averaged over
    the layers: 1 everywhere when balanced) from `layers`' router logits of the last forward."""
    n_experts, top_k = layers[0].gate.out_features, layers[0].top_k
    counts = torch.zeros(n_experts, dtype=torch.float32, device=layers[0].router_logits.device)
    prob_sum = torch.zeros_like(counts)
    rows = 0
    for layer in layers:
        probs = F.softmax(layer.router_logits, dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        counts = counts + F.one_hot(chosen.reshape(-1), n_experts).sum(0).float()
        prob_sum = prob_sum + probs.float().sum(dim=0)
        rows += probs.shape[0]
    if layers[0].dispatch is not None:  # the sums of every data-parallel rank's rows
        counts, prob_sum, rows = layers[0].dispatch.summed(counts, prob_sum, rows)
    loss = torch.sum((counts / rows) * (prob_sum / rows)) * n_experts
    return loss, (counts / (rows * top_k) * n_experts).detach()
