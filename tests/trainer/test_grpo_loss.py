"""The GRPO loss (`trainer.recipes.grpo`) and its gradient equal TRL's formula, and at ratio 1 it is the plain
policy gradient. The reference below is TRL 1.16.0's `GRPOTrainer` (trl/trainer/grpo_trainer.py): advantages as
`_generate_and_score_completions` takes them (multi_objective_aggregation="sum_then_normalize"), the loss as
`_compute_loss` takes it (loss_type="grpo", importance_sampling_level="token", no delta, no vLLM correction),
transcribed since the trainer cannot be called without a whole training setup."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import examples
from trainer.recipes import grpo

pytestmark = pytest.mark.timeout(120)


def _trl_nanstd(tensor, dim=None):
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    std = torch.sqrt(variance * count / (count - 1))
    return std.squeeze() if dim is None else std.squeeze(dim)


def _trl_advantages(rewards, num_generations, scale_rewards):
    mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std = _trl_nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        else:
            std = torch.zeros_like(rewards)
    else:
        std = _trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    adv = rewards - mean_grouped
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return adv


def _trl_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask, epsilon_low,
              epsilon_high, beta):
    advantages = advantages.unsqueeze(1)
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    if beta != 0.0:
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


@settings(max_examples=examples(60))
@given(prompts=st.integers(1, 4), generations=st.integers(1, 6), scale=st.sampled_from(grpo.SCALE_REWARDS),
       seed=st.integers(0, 2**16), binary=st.booleans())
def test_advantages_equal_trls(prompts, generations, scale, seed, binary):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(prompts * generations, generator=gen, dtype=torch.float64)
    if binary:  # groups whose rewards are all equal: advantage 0
        rewards = (rewards > 0).double()
    ours = grpo.advantages(rewards, generations, scale)
    torch.testing.assert_close(ours, _trl_advantages(rewards, generations, scale), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ours.view(-1, generations).sum(1), torch.zeros(prompts, dtype=torch.float64),
                               rtol=0, atol=1e-6)


@settings(max_examples=examples(80))
@given(completions=st.integers(1, 8), tokens=st.integers(1, 12), epsilon=st.floats(0.05, 0.5),
       epsilon_high=st.one_of(st.none(), st.floats(0.05, 0.5)), beta=st.sampled_from([0.0, 0.04, 0.3]),
       drift=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_loss_and_gradient_equal_trls_formula(completions, tokens, epsilon, epsilon_high, beta, drift, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (completions, tokens)
    logps = (-torch.rand(shape, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    old = logps.detach() + drift * torch.randn(shape, generator=gen, dtype=torch.float64)
    ref = logps.detach() + torch.randn(shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(completions, generator=gen, dtype=torch.float64)
    mask = (torch.rand(shape, generator=gen) < 0.7).double()
    loss, stats = grpo.grpo_loss(logps, old, adv, mask, epsilon, epsilon_high, beta, ref)
    (grad,) = torch.autograd.grad(loss, logps)
    reference = _trl_loss(logps, old, ref, adv, mask, epsilon, epsilon if epsilon_high is None else epsilon_high,
                          beta)
    (reference_grad,) = torch.autograd.grad(reference, logps)
    torch.testing.assert_close(loss, reference, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-9, atol=1e-12)
    assert 0 <= stats["clip_ratio"] <= 1 and stats["kl"] >= 0
    torch.testing.assert_close(stats["completion_length"], mask.sum(-1).mean())


@settings(max_examples=examples(30))
@given(completions=st.integers(1, 8), tokens=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_on_policy_the_gradient_is_the_advantage_over_the_length(completions, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(completions, tokens, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(completions, generator=gen, dtype=torch.float64)
    mask = (torch.rand(completions, tokens, generator=gen) < 0.7).double()
    loss, stats = grpo.grpo_loss(logps, logps.detach(), adv, mask, epsilon=0.2)
    (grad,) = torch.autograd.grad(loss, logps)
    expected = -adv[:, None] * mask / mask.sum(-1, keepdim=True).clamp(min=1) / completions
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    assert stats["clip_ratio"] == 0 and stats["kl"] == 0


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="num_generations=4 does not divide the 6 completions"):
        grpo.advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="scale_rewards='mean': must be one of group, batch, none"):
        grpo.advantages(torch.zeros(6), 3, "mean")
    with pytest.raises(ValueError, match="beta > 0 needs the reference"):
        grpo.grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), 0.2, beta=0.1)
