"""`recipe=rloo`: REINFORCE Leave-One-Out (Ahmadian et al., 2024) on data=prompts, as TRL 1.16's RLOOTrainer
takes it. Sampling, reward functions, the reward model and the reference are GRPO's (`trainer.recipes.grpo`); what
differs is where the KL goes, the baseline and the loss.

With beta > 0 the KL is a penalty on the reward: per completion the sum over its tokens of the first-order estimate
logp_old - logp_ref (the policy at sampling against the frozen reference; negative per token at times):

    r_i  <-  r_i - beta * sum_t (old_t - ref_t)

Each completion's baseline is the mean reward of the other completions of its prompt:

    A_i = r_i - (sum_j r_j - r_i) / (G - 1)

(with recipe.normalize_advantages, then scaled to mean 0 and std 1 over the whole generation batch, all ranks'),
and the loss takes the importance ratio per sequence, the completion's log-probability summed:

    rho_i = exp(sum_t logp_t - sum_t old_t)
    loss  = mean_i -min(rho_i * A_i, clip(rho_i, 1 - epsilon, 1 + epsilon_high) * A_i)

Metrics as TRL names them: kl (the mean per token of old - ref), clip_ratio/low_mean, clip_ratio/high_mean,
clip_ratio/region_mean (shares of completions clipped), completions/mean_length, and GRPO's rewards.
"""

from __future__ import annotations

import torch

from trainer.recipes.grpo import GRPO

METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length")


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(n,) each reward minus the mean of the others of its group; `rewards` (n,) hold the completions of each
    prompt side by side in groups of `num_generations` (>= 2)."""
    if num_generations < 2 or rewards.numel() % num_generations:
        raise ValueError(f"num_generations={num_generations} must be >= 2 and divide the {rewards.numel()} "
                         "completions")
    groups = rewards.view(-1, num_generations)
    baselines = (groups.sum(1, keepdim=True) - groups) / (num_generations - 1)
    return (groups - baselines).flatten()


def normalized(advantages: torch.Tensor) -> torch.Tensor:
    """Scaled to mean 0 and std 1 (Bessel's correction), as TRL's normalize_advantages."""
    return (advantages - advantages.mean()) / (advantages.std() + 1e-4)


def rloo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              epsilon: float, epsilon_high: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and its statistics. logps, old_logps, mask: (completions, tokens); advantages: (completions,)."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp((logps * mask).sum(-1) - (old_logps * mask).sum(-1))
    high = epsilon if epsilon_high is None else epsilon_high
    loss = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon, 1 + high) * advantages).mean()
    low_clipped = ((ratio < 1 - epsilon) & (advantages < 0)).to(logps.dtype)
    high_clipped = ((ratio > 1 + high) & (advantages > 0)).to(logps.dtype)
    stats = {"clip_ratio/low_mean": low_clipped.mean(), "clip_ratio/high_mean": high_clipped.mean(),
             "clip_ratio/region_mean": (low_clipped + high_clipped).mean(),
             "completions/mean_length": mask.sum(-1).mean()}
    return loss, {k: v.detach() for k, v in stats.items()}


class RLOO(GRPO):
    @torch.no_grad()
    def _generation_batch(self, batch: dict, accum: int) -> list:
        times: dict[str, float] = {}
        prompts, completions, total, reward_stats, old = self._generate_and_score(batch, times, accum)
        micros, mask, self.real_tokens = self.micro_rows([p for p in prompts for _ in range(self.G)], completions,
                                                         accum)
        with self.timed(times, "perf/logps_s"):
            if old is None:  # else the sampling policy's, from the background (recipe.generation.async)
                needs_old = self.r.beta > 0 or self.r.num_iterations > 1
                old = self._logps(self.model, micros) if needs_old else [None] * accum
            if self.reference is not None:
                per_token = (torch.cat(old) - torch.cat(self._logps(self.reference, micros))) * mask
                total = total - self.r.beta * per_token.sum(-1)
                reward_stats["kl"] = per_token.sum() / mask.sum().clamp(min=1)
        adv = self._rloo_advantages(total)
        times = {k: torch.tensor(v, device=self.ctx.device) for k, v in times.items()}
        self.reward_stats = {**reward_stats, **times}
        return list(zip(micros, mask.chunk(accum), adv.chunk(accum), old, strict=True))

    def _rloo_advantages(self, total: torch.Tensor) -> torch.Tensor:
        adv = rloo_advantages(total, self.G)
        if not self.r.normalize_advantages:
            return adv
        # Over the whole generation batch: every rank's.
        return normalized(self.batch_wide(adv)).view(self.dp_size, -1)[self.dp_rank]

    def loss(self, micro) -> torch.Tensor:
        rows, mask, adv, old = micro
        with self.ctx.autocast:
            logps = self.token_logps(self.model, rows)
        loss, stats = rloo_loss(logps, logps.detach() if old is None else old, adv, mask, self.r.epsilon,
                                self.r.epsilon_high)
        accum = self.cfg.train.grad_accum_steps
        self.add_stats(stats, 1 / accum)
        return loss / accum
