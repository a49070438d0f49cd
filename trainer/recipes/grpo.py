"""The loss of Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath), as TRL's GRPOTrainer takes it
(`loss_type="grpo"`, token-level importance sampling), for a future `recipe=grpo`.

Each prompt gets G completions; each completion's reward (the weighted sum over the reward functions) becomes its
advantage within its group:

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)      (scale_rewards=group; batch: the batch's std;
                                                              none: not divided; std with Bessel's correction)

and with per-token log-probabilities under the policy (logp), the policy that generated (old) and the frozen
reference (ref), the ratio rho = exp(logp - old) per completion token:

    token loss = -min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A) + beta * k3
    k3         = exp(ref - logp) - (ref - logp) - 1
    loss       = mean over completions of (the mean of its token losses)

The KL term is the k3 estimator of KL(policy || reference). A completion with no counted token adds 0.
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")
METRICS = ("kl", "clip_ratio", "completion_length")


def advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """(n,) advantages of `rewards` (n,), the completions of each prompt side by side in groups of
    `num_generations`."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: must be one of {', '.join(SCALE_REWARDS)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"num_generations={num_generations} does not divide the {rewards.numel()} completions")
    groups = rewards.view(-1, num_generations)
    centred = (groups - groups.mean(1, keepdim=True)).flatten()
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = groups.std(1, keepdim=True).expand_as(groups).flatten() if num_generations > 1 else 0.0
    else:
        std = rewards.std() if rewards.numel() > 1 else 0.0
    return centred / (std + 1e-4)


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              epsilon: float, epsilon_high: float | None = None, beta: float = 0.0,
              ref_logps: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and its statistics (masked means over completion tokens of the KL and of the share of tokens
    clipped; the mean completion length). logps, old_logps, ref_logps, mask: (completions, tokens);
    advantages: (completions,)."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    adv = advantages[:, None]
    high = epsilon if epsilon_high is None else epsilon_high
    token_loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv)
    kl = torch.zeros_like(logps)
    if beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        token_loss = token_loss + beta * kl
    lengths = mask.sum(-1)
    loss = ((token_loss * mask).sum(-1) / lengths.clamp(min=1)).mean()
    clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    counted = mask.sum().clamp(min=1)
    stats = {
        "kl": (kl * mask).sum() / counted,
        "clip_ratio": (clipped.to(mask.dtype) * mask).sum() / counted,
        "completion_length": lengths.mean(),
    }
    return loss, {k: v.detach() for k, v in stats.items()}
