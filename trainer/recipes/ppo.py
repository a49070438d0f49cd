"""`recipe=ppo`: Proximal Policy Optimization with a value model (Schulman et al., 2017; Ouyang et al., 2022) on
data=prompts, as TRL's PPOTrainer ran it (TRL 0.28, the last release that ships `PPOTrainer`/`PPOConfig`: its
names, defaults and numbers). Sampling, reward functions and the reward model are GRPO's (`trainer.recipes.grpo`),
one completion of each prompt.

A rollout batch (recipe.num_mini_batches global batches of prompts) is sampled, scored (the weighted reward, less
recipe.missing_eos_penalty where a completion holds no end token), and read once more without gradients: the
policy's log-probabilities (old), the reference's (ref) and the value model's values, at the logits divided by
recipe.temperature + 1e-7, each a (completions, T) table over the completion's positions (T the rank's longest
completion; a completion of L tokens counts positions t < L, and its values t <= L: TRL's padding_mask and
padding_mask_p1). Per token the KL penalty and, at position L (L - 1 when L = T), the score:

    kl_t = old_t - ref_t (k1)  or  (e^(ref_t - old_t) - 1) - (ref_t - old_t) (k3)
    r_t  = -kl_coef kl_t  (+ score at the end)          (whiten_rewards: scaled to std 1 over the values' positions)

then GAE over the positions, from the last back (V beyond T is 0):

    delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   returns_t = A_t + V_t

the advantages whitened over the rank's counted positions (mean 0, std 1 with Bessel's correction). Each of the
recipe.num_ppo_epochs epochs shuffles the rollout and takes its recipe.num_mini_batches mini-batches, one training
step (one optimizer step) each, its micro-batches' losses

    ratio = e^(logp - old)
    pg    = masked mean over counted positions of max(-A ratio, -A clip(ratio, 1 - cliprange, 1 + cliprange))
    vf    = 0.5 masked mean over value positions of max((v - R)^2, (clip(v, V - cliprange_value, V + cliprange_value)
            - R)^2)
    loss  = pg + vf_coef vf

divided by the micro-batches of a step (TRL's accumulation). Metrics as TRL names them: objective/kl (the rollout's
KL summed per completion, averaged), objective/entropy (minus the old log-probabilities summed per completion),
objective/non_score_reward, objective/rlhf_reward, objective/scores, policy/approxkl_avg, policy/clipfrac_avg,
loss/policy_avg, loss/value_avg, val/clipfrac_avg, policy/entropy_avg (the mean over counted tokens: TRL's counts
the padding too), val/ratio, val/num_eos_tokens; and val/explained_variance, 1 - Var(returns - V) / Var(returns)
over the rollout's value positions.

The value model (recipe.value_model): separate, a model of its own with a score head (`trainer.models.score`), from
recipe.reward_model.path when given (as TRL's examples start it), else from the policy's starting weights with a
fresh head; it is full (no adapters) under peft=lora, as TRL's. It is placed like the policy and kept as the
policy's `value_model` submodule (`attach_value_model`, by the worker), so that the run's optimizer, gradient
clipping and checkpoints hold it; the export leaves it out. shared: a value head, one linear layer on the policy's
final hidden states (`value_head`), read in the policy's forward. Under tensor parallelism either one-output head
is whole on each rank (`trainer.parallel.parallelize`) and the rows' widths a multiple of the sequence split. The
reference is the policy with its adapters off under peft=lora, else a frozen copy of the starting weights; none
with recipe.kl_coef=0. The eval loss is minus the mean reward of completions sampled for the eval prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import nn

from trainer.data import packing
from trainer.models.chunked import IGNORE
from trainer.parallel.assembly import assemble
from trainer.recipes.base import Recipe
from trainer.recipes.grpo import GRPO, rows

# A micro-batch's tables from the rollout, by completion, in the order `loss` takes them.
TABLES = ("starts", "old", "values", "advantages", "returns", "mask", "vmask")
# The metrics of a training step, TRL's names.
METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
           "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
           "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/num_eos_tokens", "val/explained_variance")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """The mean of `values` where `mask` holds (along `axis`, or over all)."""
    if axis is not None:
        return (values * mask).sum(axis) / mask.sum(axis)
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """The variance of `values` where `mask` holds (Bessel's correction with `unbiased`)."""
    centred = values - masked_mean(values, mask)
    variance = masked_mean(centred**2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError(f"the variance of {int(count)} value(s) with Bessel's correction: give more completions "
                             "a rank")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`values` scaled to std 1 where `mask` holds, and centred on 0 (`shift_mean`), as TRL's masked_whiten."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per token KL(policy || reference) estimate: k1 logp - ref, or k3 (e^(ref - logp) - 1) - (ref - logp)."""
    logr = ref_logps - logps
    if estimator == "k1":
        return -logr
    if estimator == "k3":
        return (logr.exp() - 1) - logr
    raise ValueError(f"kl_estimator={estimator!r}: must be k1 or k3")


def token_rewards(kl: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, kl_coef: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the per-position rewards, the KL part of them): -kl_coef kl (kl 0 past each completion), each completion's
    score added at position L (its length; L - 1 when L is the table's width T), as TRL places it."""
    width = kl.shape[1]
    non_score = -kl_coef * kl
    rewards = non_score.clone()
    end = torch.where(lengths < width, lengths, lengths - 1)
    rewards[torch.arange(rewards.shape[0], device=rewards.device), end] += scores
    return rewards, non_score


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of Generalized Advantage Estimation over (completions, T) `rewards` and `values` (0
    where they do not count), the value past T taken as 0."""
    last = torch.zeros_like(rewards[:, 0])
    reversed_ = []
    for t in reversed(range(rewards.shape[1])):
        following = values[:, t + 1] if t < rewards.shape[1] - 1 else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * following - values[:, t]
        last = delta + gamma * lam * last
        reversed_.append(last)
    advantages = torch.stack(reversed_[::-1], 1)
    return advantages, advantages + values


def rollout_targets(logps: torch.Tensor, ref_logps: torch.Tensor | None, values: torch.Tensor, scores: torch.Tensor,
                    lengths: torch.Tensor, r) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(whitened advantages, returns, the rollout's metrics) of a rank's rollout: logps, ref_logps, values
    (completions, T) as sampled (ref None: kl_coef 0, no reference), scores and lengths (completions,); `r` the
    recipe section (kl_coef, kl_estimator, whiten_rewards, gamma, lam)."""
    index = torch.arange(logps.shape[1], device=logps.device)[None]
    mask, vmask = index < lengths[:, None], index <= lengths[:, None]
    kl = (kl_penalty(logps, ref_logps, r.kl_estimator) if ref_logps is not None else torch.zeros_like(logps)) * mask
    rewards, non_score = token_rewards(kl, scores, lengths, r.kl_coef)
    if r.whiten_rewards:
        rewards = masked_whiten(rewards, vmask, shift_mean=False) * vmask
    advantages, returns = gae(rewards, values * vmask, r.gamma, r.lam)
    advantages = masked_whiten(advantages, mask) * mask
    residual = masked_var(returns - values, vmask, unbiased=False)
    stats = {"objective/kl": kl.sum(1).mean(), "objective/entropy": (-logps * mask).sum(1).mean(),
             "objective/non_score_reward": non_score.sum(1).mean(),
             "objective/rlhf_reward": non_score.sum(1).mean() + scores.mean(), "objective/scores": scores.mean(),
             "val/explained_variance": 1 - residual / masked_var(returns, vmask, unbiased=False).clamp(min=1e-8)}
    return advantages, returns, stats


def ppo_loss(logps: torch.Tensor, values: torch.Tensor, old_logps: torch.Tensor, old_values: torch.Tensor,
             advantages: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, vmask: torch.Tensor,
             cliprange: float, cliprange_value: float, vf_coef: float) -> tuple[torch.Tensor, dict]:
    """A micro-batch's PPO loss pg + vf_coef vf and its statistics (TRL's names), all (completions, T): the policy's
    and the value model's outputs, the rollout's, the whitened advantages, the returns, the counted positions
    (`mask`) and the value's (`vmask`)."""
    mask, vmask = mask.to(logps.dtype), vmask.to(values.dtype)
    clipped_v = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1, vf_losses2 = (values - returns) ** 2, (clipped_v - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), vmask)
    diff = (logps - old_logps) * mask
    ratio = torch.exp(diff)
    pg_losses, pg_losses2 = -advantages * ratio, -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), mask)
    with torch.no_grad():
        stats = {"policy/approxkl_avg": 0.5 * (diff**2).mean(),
                 "policy/clipfrac_avg": masked_mean((pg_losses2 > pg_losses).to(mask.dtype), mask),
                 "loss/policy_avg": pg_loss, "loss/value_avg": vf_loss,
                 "val/clipfrac_avg": masked_mean((vf_losses2 > vf_losses1).to(vmask.dtype), vmask),
                 "val/ratio": ratio.mean()}
    return pg_loss + vf_coef * vf_loss, {k: v.detach() for k, v in stats.items()}


def inner(model: nn.Module) -> nn.Module:
    """The module a wrapper (DDP) runs: where the value model or head is kept."""
    return getattr(model, "module", model)


def attach_value_model(model: nn.Module, cfg, dims, kernels) -> None:
    """recipe.value_model=separate: the value model assembled like the policy (full, a score head) and kept as the
    policy's `value_model` submodule, so that the run's optimizer, clipping and checkpoints hold it."""
    path = cfg.recipe.reward_model.path
    source = dataclasses.replace(cfg.model, name="hf", path=path) if path else cfg.model
    inner(model).value_model = assemble(source, cfg, dims, kernels, peft=False, qat=False, score_head=True)


def positions(out: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, width) of per-position `out` (rows, seq) from each row's `starts` on (its prompt's last position)."""
    index = (starts[:, None] + torch.arange(width, device=out.device)[None]).clamp(max=out.shape[1] - 1)
    return out.gather(1, index)


class PPO(GRPO):
    def __init__(self, cfg, model, ctx):
        Recipe.__init__(self, cfg, model, ctx)
        r = cfg.recipe
        self.r, self.G = r, 1
        self.sampling(cfg, model, ctx, r.kl_coef)
        self.packing = packing.choose(cfg.data.packing, False)
        self.rollouts, self.rollout, self.order = None, None, None
        self.logps_fn = functools.partial(ctx.kernels.token_logps_entropy, temperature=r.temperature + 1e-7)
        self.steps_per_rollout = r.num_ppo_epochs * r.num_mini_batches
        self.done = 0  # the steps trained on the rollout held
        self.reward_stats: dict[str, torch.Tensor] = {}

    @property
    def rows_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.r.num_mini_batches

    def data_steps(self, step: int) -> int:
        return math.ceil(step / self.steps_per_rollout)

    def wants_batch(self, step: int) -> bool:
        return self.rollout is None or step % self.steps_per_rollout == 0

    def micro_batches(self, batch: dict | None, accum: int) -> list:
        if batch is not None:
            self.rollout, self.done = self._rollout(batch, accum), 0
        mini = self.done % self.r.num_mini_batches
        if mini == 0:  # each epoch its own order of the rollout's completions
            n = self.rollout["rows"][0].shape[0]
            self.order = torch.randperm(n, generator=self.generator, device=self.ctx.device)
        self.done += 1
        self.add_stats(self.reward_stats)
        size = self.order.numel() // self.r.num_mini_batches
        picked = self.order[mini * size:(mini + 1) * size]
        micros = []
        for index in picked.chunk(accum):
            micro, real = self._packed(index)
            micros.append((micro, *(self.rollout[k][index] for k in TABLES)))
            self.count(real, micros[-1][-2].sum())
        return micros

    def _packed(self, index: torch.Tensor) -> tuple[packing.Packed, int]:
        """(the micro-batch of the rollout's rows `index`, as `data.packing` says; its real input tokens)."""
        tokens, target, real = self.rollout["rows"]
        real = real[index.cpu()]
        return (packing.collate(tokens[index], target[index], real, self.packing, self.ctx.dims.sequence_multiple),
                int(real.sum()))

    def loss(self, micro) -> torch.Tensor:
        packed, starts, old, old_values, adv, returns, mask, vmask = micro
        with self.ctx.autocast:
            logps, entropy, values = self._forward(packed, starts, mask.shape[1])
        loss, stats = ppo_loss(logps, values, old, old_values, adv, returns, mask, vmask, self.r.cliprange,
                               self.r.cliprange_value, self.r.vf_coef)
        stats["policy/entropy_avg"] = masked_mean(entropy.detach(), mask.to(entropy.dtype))
        accum = self.cfg.train.grad_accum_steps
        self.add_stats(stats, 1 / accum)
        return loss / accum

    def _forward(self, micro: packing.Packed, starts: torch.Tensor, width: int, model=None, values: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(log-probabilities, entropy, values) of a micro-batch's completions, each (rows, width) from each row's
        prompt's last position: under `model` (the policy by default) and its value model (`values`)."""
        model = self.model if model is None else model
        shared = values and self.r.value_model == "shared"
        out = model(micro.tokens[:, :-1], micro.target, micro.inputs_documents,
                    loss_fn=functools.partial(self._shared_fn, inner(model).value_head) if shared else self.logps_fn)
        out = [packing.unpack(o, micro) for o in out]
        if values and not shared:
            vm = inner(self.model).value_model
            v = vm(micro.tokens[:, :-1]) if micro.documents is None else vm(micro.tokens[:, :-1], None,
                                                                             micro.inputs_documents)
            out.append(packing.unpack(v[..., 0].float(), micro))
        tables = [positions(o, starts, width) for o in out]
        return tables[0], tables[1], tables[2] if values else None

    def _shared_fn(self, head: nn.Module, hidden, weight, targets, **cap):
        """recipe.value_model=shared: the policy's log-probabilities and entropy, and the value head's output at
        every position, from the same final hidden states."""
        logps, entropy = self.logps_fn(hidden, weight, targets, **cap)
        return logps, entropy, head(hidden)[..., 0].float()

    def eval_loss(self, batch: dict) -> torch.Tensor:
        generator = torch.Generator(self.ctx.device).manual_seed(self.cfg.train.seed + 7919 * (self.dp_rank + 1))
        prompts, rows_ = self._prompts(batch)
        completions = self._sample(prompts, generator)
        return -self._scores(rows_, prompts, completions)[0].mean()

    def _scores(self, rows_: list[dict], prompts: list[list[int]], completions: list[list[int]]) -> tuple:
        """(each completion's score, less recipe.missing_eos_penalty where it holds no end token; the reward
        statistics)."""
        total, stats = self._rewards(rows_, prompts, completions)
        ends = set(self.text.eos)
        eos = torch.tensor([any(t in ends for t in c) for c in completions], device=total.device)
        if self.r.missing_eos_penalty is not None:
            total = total - self.r.missing_eos_penalty * (~eos).to(total.dtype)
        stats["val/num_eos_tokens"] = eos.sum().float()
        return total, stats

    @torch.no_grad()
    def _rollout(self, batch: dict, accum: int) -> dict:
        """Sample, score and read a rollout batch: every table the steps on it take, by completion."""
        times: dict[str, float] = {}
        prompts, rows_ = self._prompts(batch)
        self.model.eval()
        with self.timed(times, "perf/generate_s"):
            completions = self._sample(prompts, self.generator)
        with self.timed(times, "perf/score_s"):
            scores, stats = self._scores(rows_, prompts, completions)
        tokens, target, real = ppo_rows(prompts, completions, self.text.pad, self.ctx.dims.sequence_multiple)
        device = self.ctx.device
        ro = {"rows": (tokens.to(device), target.to(device), real),
              "starts": torch.tensor([len(p) - 1 for p in prompts], device=device)}
        lengths = torch.tensor([len(c) for c in completions], device=device)
        width = int(lengths.max())
        self.rollout = ro
        with self.timed(times, "perf/logps_s"):
            old, values, ref = self._read(ro, width, accum)
        self.model.train()
        ro["advantages"], ro["returns"], rollout_stats = rollout_targets(old, ref, values, scores, lengths, self.r)
        index = torch.arange(width, device=device)[None]
        ro.update(old=old, values=values * (index <= lengths[:, None]), mask=index < lengths[:, None],
                  vmask=index <= lengths[:, None])
        self.reward_stats = {**stats, **rollout_stats, **{k: torch.tensor(v, device=device) for k, v in times.items()}}
        return ro

    def _read(self, ro: dict, width: int, accum: int) -> tuple:
        """The rollout's old log-probabilities, values and reference log-probabilities (or None), (rows, width)."""
        n = ro["rows"][0].shape[0]
        parts = []
        for index in torch.arange(n, device=self.ctx.device).chunk(accum * self.r.num_mini_batches):
            micro, starts = self._packed(index)[0], ro["starts"][index]
            with self.ctx.autocast:
                logps, _, values = self._forward(micro, starts, width)
                ref = None
                if self.reference is not None:
                    ref = self._forward(micro, starts, width, self.reference, values=False)[0]
            parts.append((logps, values, ref))
        old, values, ref = (None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True))
        return old, values, ref


def ppo_rows(prompts: list[list[int]], completions: list[list[int]], pad: int, multiple: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO's rows (`trainer.recipes.grpo.rows`, the inputs' width a multiple of `multiple`) with one more input
    after each completion, so that the value after its last token is read (TRL's padding_mask_p1), never a
    target."""
    tokens, target, real = rows(prompts, [[*c, pad] for c in completions], pad, multiple)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        target[i, len(p) + len(c) - 1] = IGNORE
    return tokens, target, real

