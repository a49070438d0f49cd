"""`recipe=rloo` on `data=prompts`: the loss and its gradient are TRL 1.16's (its RLOOTrainer._compute_loss called
on generated cases), the leave-one-out advantages and the KL taken from the reward are its formulas, and a toy task
is learnt on a tiny debug model (the mean reward rises)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import compose_refused, examples, read_metrics
from tests.trainer.recipes.test_grpo import ARGS, REWARDS_ON_PATH, TOY, prompts  # noqa: F401 (a fixture)
from trainer.recipes import rloo

pytestmark = pytest.mark.timeout(300)


def _trl_loss(per_token_logps, old_logps, advantages, mask, epsilon_low, epsilon_high):
    """TRL's own `RLOOTrainer._compute_loss`, on a stand-in trainer whose model gives `per_token_logps`."""
    from trl.trainer.rloo_trainer import RLOOTrainer

    same = SimpleNamespace(gather=lambda t: t, reduce=lambda t, reduction: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, aux_loss_enabled=False, accelerator=same,
        model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token_logps, torch.zeros_like(per_token_logps),
                                                             None))
    n, t = mask.shape
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": mask,
              "old_logps": old_logps, "advantages": advantages}
    return RLOOTrainer._compute_loss(trainer, None, inputs)


@settings(max_examples=examples(40))
@given(completions=st.integers(1, 8), tokens=st.integers(1, 10), epsilon=st.floats(0.05, 0.5),
       epsilon_high=st.one_of(st.none(), st.floats(0.05, 0.5)), drift=st.floats(0.0, 0.5),
       seed=st.integers(0, 2**16))
def test_loss_and_gradient_equal_trls(completions, tokens, epsilon, epsilon_high, drift, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (completions, tokens)
    logps = (-torch.rand(shape, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    mask = (torch.rand(shape, generator=gen) < 0.7).double()
    old = logps.detach() + drift * torch.randn(shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(completions, generator=gen, dtype=torch.float64)
    loss, stats = rloo.rloo_loss(logps, old, adv, mask, epsilon, epsilon_high)
    (grad,) = torch.autograd.grad(loss, logps)
    high = epsilon if epsilon_high is None else epsilon_high
    reference = _trl_loss(logps, (old * mask).sum(1), adv, mask, epsilon, high)
    (reference_grad,) = torch.autograd.grad(reference, logps)
    torch.testing.assert_close(loss, reference, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-9, atol=1e-12)
    assert 0 <= stats["clip_ratio/region_mean"] <= 1


def _trl_rewards_and_advantages(rewards, old, ref, mask, beta, num_generations, normalize):
    """RLOOTrainer._generate_and_score_completions' KL penalty and advantages (TRL 1.16, every completion
    scorable), transcribed: the method needs a whole training setup."""
    if beta != 0.0:
        rewards = rewards - beta * ((old - ref) * mask).sum(-1)
    grouped = rewards.view(-1, num_generations)
    baselines = (grouped.sum(1, keepdim=True) - grouped) / (num_generations - 1)
    advantages = rewards - baselines.view(-1)
    if normalize:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-4)
    return advantages


@settings(max_examples=examples(30))
@given(prompts_=st.integers(1, 4), generations=st.integers(2, 6), beta=st.sampled_from([0.0, 0.05, 0.5]),
       normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_advantages_and_the_kl_in_the_reward_are_trls(prompts_, generations, beta, normalize, seed):
    gen = torch.Generator().manual_seed(seed)
    n = prompts_ * generations
    rewards = torch.randn(n, generator=gen, dtype=torch.float64)
    old, ref = (torch.randn(n, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = (torch.rand(n, 5, generator=gen) < 0.7).double()
    penalised = rewards - beta * ((old - ref) * mask).sum(-1)
    ours = rloo.rloo_advantages(penalised, generations)
    if normalize:
        ours = rloo.normalized(ours)
    expected = _trl_rewards_and_advantages(rewards, old, ref, mask, beta, generations, normalize)
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-9)


def test_the_mean_reward_rises_on_a_toy_task(prompts, run_cli, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    proc = run_cli(*ARGS, "recipe=rloo", f"data.path={prompts}", f"recipe.reward_funcs=[{TOY}]",
                   "train.max_steps=20", "train.eval_every=20", f"hydra.run.dir={run}", env=REWARDS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(str(run))
    for key in ("reward", "kl", "clip_ratio/region_mean", "completions/mean_length", "perf/generate_s",
                "perf/score_s", "perf/logps_s"):
        assert key in lines[-1], key
    first = sum(m["reward"] for m in lines[:5]) / 5
    last = sum(m["reward"] for m in lines[-5:]) / 5
    assert first < 0.2 and last > first + 0.15, (first, last)
    assert lines[-1]["kl"] != 0  # the reference is the starting policy, beta 0.05 as TRL's


def test_async_generation_trains_on_the_batch_sampled_during_the_step_before(prompts, run_cli, tmp_path):  # noqa: F811
    """recipe.generation.async=true: from the second step on, each step trains on completions sampled one update
    earlier (the lag logged), their old log-probabilities the sampling weights', so the ratio is no longer 1."""
    run = tmp_path / "run"
    proc = run_cli(*ARGS, "recipe=rloo", f"data.path={prompts}", f"recipe.reward_funcs=[{TOY}]", "recipe.beta=0",
                   "recipe.generation.async=true", "train.max_steps=4", "train.eval_every=4",
                   f"hydra.run.dir={run}", env=REWARDS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(str(run))
    assert [m["sample/staleness_mean"] for m in lines] == [0, 1, 1, 1]
    assert all(m["perf/rollout_wait_s"] >= 0 and m["perf/generate_s"] > 0 for m in lines)
    # On policy (the first step) the sequence ratio is 1 and the loss is minus the mean advantage, 0; a batch
    # sampled before the last update is not.
    assert lines[0]["loss"] == pytest.approx(0, abs=1e-6) and any(abs(m["loss"]) > 1e-6 for m in lines[1:])


def test_rloo_runs_that_cannot_train_are_refused(prompts, tmp_path, capsys):  # noqa: F811
    base = [*ARGS, "recipe=rloo", f"data.path={prompts}"]
    assert "recipe=rloo needs at least one reward function" in compose_refused(tmp_path, capsys, *base)
    assert "recipe.min_p=2.0: must be in [0, 1]" in compose_refused(
        tmp_path, capsys, *base, f"recipe.reward_funcs=[{TOY}]", "recipe.min_p=2.0")
    assert "recipe.reward_model.path=" in compose_refused(
        tmp_path, capsys, *base, f"recipe.reward_funcs=[{TOY}]", f"recipe.reward_model.path={tmp_path}")
    assert "recipe.generation.async=True: samples in a background thread" in compose_refused(
        tmp_path, capsys, *base, f"recipe.reward_funcs=[{TOY}]", "recipe.generation.async=true", "strategy=fsdp2")
    assert "use recipe.num_iterations=1" in compose_refused(
        tmp_path, capsys, *base, f"recipe.reward_funcs=[{TOY}]", "recipe.generation.async=true",
        "recipe.num_iterations=2")
