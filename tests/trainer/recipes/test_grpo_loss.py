"""The GRPO loss (`trainer.recipes.grpo`), its gradient and its metrics equal TRL 1.16's own `GRPOTrainer.
_compute_loss` (called through tests/trainer/trl_reference.py) for every loss type and importance-sampling level,
over micro-batches and ranks (dapo's normaliser on two real gloo ranks), and at ratio 1 it is the plain policy
gradient. The advantages are computed inline in TRL's `_generate_and_score_completions`, which cannot be called
without a whole generation setup: they are compared with its lines transcribed below
(multi_objective_aggregation="sum_then_normalize")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import examples
from tests.trainer import trl_reference
from trainer.config import recipe as config_recipe
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


def _case(gen, completions, tokens, drift):
    shape = (completions, tokens)
    logps = (-torch.rand(shape, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    old = logps.detach() + drift * torch.randn(shape, generator=gen, dtype=torch.float64)
    ref = logps.detach() + torch.randn(shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(completions, generator=gen, dtype=torch.float64)
    mask = (torch.rand(shape, generator=gen) < 0.7).double()
    return logps, old, ref, adv, mask


# The loss types' own settings and the KL term's, drawn for the property test.
SETTINGS = st.fixed_dictionaries({
    "delta": st.one_of(st.none(), st.floats(1.05, 3.0)), "sapo_temperature_pos": st.floats(0.2, 3.0),
    "sapo_temperature_neg": st.floats(0.2, 3.0), "vespo_k_pos": st.floats(0.0, 4.0),
    "vespo_lambda_pos": st.floats(0.1, 4.0), "vespo_k_neg": st.floats(0.0, 4.0),
    "vespo_lambda_neg": st.floats(0.1, 4.0), "use_bias_correction_kl": st.booleans()})


def _both(logps, old, ref, adv, mask, loss_type, level="token", epsilon=0.2, epsilon_high=None, beta=0.0, accum=1,
          ranks=1, everyone=None, max_length=None, **settings):
    """(our loss, its statistics), (TRL's loss, its metrics) of one micro-batch of a generation batch of `accum`
    micro-batches on each of `ranks` ranks, `everyone` completion tokens in all (dapo's, cispo's and vespo's
    normaliser: made up here)."""
    everyone = float(mask.sum()) * ranks * accum + 3.0 if everyone is None else everyone
    ours = grpo.grpo_loss(logps, old, adv, mask, epsilon, epsilon_high, beta, ref, loss_type, level, accum,
                          torch.tensor(everyone) / ranks, max_length, **settings)
    theirs = trl_reference.grpo(
        logps, old, ref, adv, mask, loss_type=loss_type, importance_sampling_level=level, epsilon=epsilon,
        epsilon_high=epsilon_high, beta=beta, accum=accum, num_processes=ranks, num_items_in_batch=everyone,
        max_completion_length=max_length, **settings)
    return ours, theirs


@settings(max_examples=examples(120))
@given(completions=st.integers(1, 8), tokens=st.integers(1, 12), epsilon=st.floats(0.05, 0.5),
       epsilon_high=st.one_of(st.none(), st.floats(0.05, 6.0)), beta=st.sampled_from([0.0, 0.04, 0.3]),
       drift=st.floats(0.0, 1.0), seed=st.integers(0, 2**16), loss_type=st.sampled_from(grpo.LOSS_TYPES),
       level=st.sampled_from(grpo.IMPORTANCE_LEVELS), accum=st.integers(1, 4), ranks=st.integers(1, 4),
       max_length=st.integers(12, 32), settings=SETTINGS)
def test_loss_gradient_and_metrics_equal_trls(completions, tokens, epsilon, epsilon_high, beta, drift, seed,
                                              loss_type, level, accum, ranks, max_length, settings):
    """Every loss type at both importance-sampling levels with its settings drawn, in float64, against TRL's own
    `GRPOTrainer._compute_loss`: loss, gradient and the metrics TRL logs for it."""
    gen = torch.Generator().manual_seed(seed)
    logps, old, ref, adv, mask = _case(gen, completions, tokens, drift)
    (loss, stats), (reference, metrics) = _both(logps, old, ref, adv, mask, loss_type, level, epsilon, epsilon_high,
                                                beta, accum, ranks, max_length=max_length, **settings)
    (grad,) = torch.autograd.grad(loss, logps)
    (reference_grad,) = torch.autograd.grad(reference, logps)
    torch.testing.assert_close(loss, reference, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-9, atol=1e-12)
    assert set(stats) == set(grpo.METRICS[loss_type])
    for key in set(stats) - {"completions/mean_length", *(["kl"] * (not beta))}:
        if mask.sum() or level == "sequence" or loss_type == "vespo":
            assert float(stats[key]) == pytest.approx(metrics[key][0], rel=1e-6, abs=1e-7), key  # TRL counts in fp32
    torch.testing.assert_close(stats["completions/mean_length"], mask.sum(-1).mean())


# Each loss type's settings off TRL's defaults, for the float32 test below.
OFF_DEFAULT = {"cispo": {"epsilon_high": 1.1}, "sapo": {"sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.6},
               "vespo": {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.5},
               **{t: {"epsilon_high": 0.28, "delta": 1.4} for t in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")}}


def trl_parity(loss_type: str, level: str, seed: int) -> tuple[float, float]:
    """(|loss - TRL's|, max |gradient - TRL's| over the parameters) of a tiny model's GRPO loss in float32 on a
    micro-batch of 6 completions (one of 2 on each of 2 ranks; KL at beta 0.04; old log-probabilities a step
    away), each loss computed from the same log-probabilities of the model's forward."""
    from trainer.models import chunked
    from trainer.models.llama import Transformer

    torch.manual_seed(seed)
    model = Transformer(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=90, max_seq_len=64,
                        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    model.init_buffers()
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 89, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 9, (6,), generator=gen)]
    completions = [torch.randint(0, 89, (int(n),), generator=gen).tolist()
                   for n in torch.randint(1, 12, (6,), generator=gen)]
    (micro,), mask, _ = grpo.micro_rows(prompts, completions, 89, "padding_free", 1)
    logps = grpo.token_logps(model, micro, chunked.token_logps)
    old = logps.detach() + 0.3 * torch.randn(logps.shape, generator=gen) * mask
    ref = logps.detach() + 0.3 * torch.randn(logps.shape, generator=gen) * mask
    adv = torch.randn(6, generator=gen)
    found = []
    for loss, _ in _both(logps, old, ref, adv, mask.float(), loss_type, level, beta=0.04, accum=2, ranks=2,
                         everyone=float(mask.sum()) * 4 - 5, max_length=16, **OFF_DEFAULT[loss_type]):
        found.append((loss, torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)))
    (loss, grads), (reference, reference_grads) = found
    return (float((loss - reference).detach().abs()),
            max(float((g - r).abs().max()) for g, r in zip(grads, reference_grads, strict=True)))


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_each_loss_type_trains_a_tiny_model_as_trl_does(loss_type):
    """Each of TRL 1.16's eight loss types, at each importance-sampling level recipe=grpo takes for it, with its
    settings off their defaults: the same loss and gradients as TRL's `_compute_loss` to 1e-5 in float32."""
    for level in [config_recipe.LOSS_LEVELS[loss_type]] if loss_type in config_recipe.LOSS_LEVELS else \
            grpo.IMPORTANCE_LEVELS:
        for seed in range(2):
            loss_diff, grad_diff = trl_parity(loss_type, level, seed)
            assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (level, seed, loss_diff, grad_diff)


def _dapo_rank(rank: int, world: int, store: str, case: list, out: str) -> None:
    """One of `world` gloo ranks: its micro-batches' dapo losses with the normaliser it reduces with the others,
    and its gradient averaged over the ranks as DDP averages it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    micro = case[rank]
    per_rank = grpo.dapo_tokens_per_rank([m[4] for m in micro])
    grads = []
    for logps, old, ref, adv, mask in micro:
        logps = logps.clone().requires_grad_()
        loss, _ = grpo.grpo_loss(logps, old, adv, mask, 0.2, 0.28, 0.04, ref, "dapo", "token", len(micro), per_rank)
        grads.append(torch.autograd.grad(loss, logps)[0] / world)
    torch.save(grads, f"{out}.{rank}")
    dist.destroy_process_group()


def test_dapo_normalises_by_every_ranks_tokens_as_trl_does(tmp_path):
    """Two gloo ranks, two micro-batches each, of different lengths and masks: each rank's gradient, averaged as
    DDP does, equals TRL's with num_items_in_batch the tokens of every rank, and the step's is the gradient of the
    mean token loss over every token of every rank and micro-batch."""
    gen = torch.Generator().manual_seed(7)
    case = [[[t.detach() for t in _case(gen, n, length, 0.5)] for n, length in shapes]
            for shapes in ([(3, 5), (2, 7)], [(4, 3), (1, 9)])]
    out = str(tmp_path / "grads")
    # Forked: the ranks start with this process's imports (a spawned one would import TRL and torch again).
    mp.start_processes(_dapo_rank, args=(2, str(tmp_path / "store"), case, out), nprocs=2, join=True,
                       start_method="fork")
    everyone = sum(float(m[4].sum()) for micro in case for m in micro)
    for rank, micro in enumerate(case):
        got = torch.load(f"{out}.{rank}")
        for (logps, old, ref, adv, mask), grad in zip(micro, got, strict=True):
            logps = logps.clone().requires_grad_()
            trl_loss, _ = trl_reference.grpo(logps, old, ref, adv, mask, loss_type="dapo", epsilon=0.2,
                                             epsilon_high=0.28, beta=0.04, accum=2, num_processes=2,
                                             num_items_in_batch=everyone)
            expected = torch.autograd.grad(trl_loss, logps)[0] / 2  # DDP's average over the 2 ranks
            torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
            # The same as the gradient of (sum of token losses over every token) / (every token): a global mean.
            loss, _ = grpo.grpo_loss(logps, old, adv, mask, 0.2, 0.28, 0.04, ref, "bnpo")
            local = torch.autograd.grad(loss * mask.sum().clamp(min=1) / everyone, logps)[0]
            torch.testing.assert_close(grad, local, rtol=1e-9, atol=1e-12)


@settings(max_examples=examples(30))
@given(completions=st.integers(1, 8), tokens=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_on_policy_the_gradient_is_the_advantage_over_the_length(completions, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(completions, tokens, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(completions, generator=gen, dtype=torch.float64)
    mask = (torch.rand(completions, tokens, generator=gen) < 0.7).double()
    loss, stats = grpo.grpo_loss(logps, logps.detach(), adv, mask, epsilon=0.2, loss_type="grpo")
    (grad,) = torch.autograd.grad(loss, logps)
    expected = -adv[:, None] * mask / mask.sum(-1, keepdim=True).clamp(min=1) / completions
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    assert stats["clip_ratio/region_mean"] == 0 and stats["kl"] == 0


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="num_generations=4 does not divide the 6 completions"):
        grpo.advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="scale_rewards='mean': must be one of group, batch, none"):
        grpo.advantages(torch.zeros(6), 3, "mean")
    with pytest.raises(ValueError, match="beta > 0 needs the reference"):
        grpo.grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), 0.2, beta=0.1)


@pytest.mark.parametrize("multiple", [1, 4])
def test_every_packing_gives_the_padded_rows_logps_and_losses(multiple):
    """data.packing on grpo's and rloo's rows (a prompt, its completion, padding to the longest row): padded to the
    micro-batch's longest row, or packed into one row (each prompt and completion a document), the
    log-probabilities, the grpo and rloo losses and their gradients of the rows as made; two micro-batches."""
    from trainer.models import chunked
    from trainer.models.llama import Transformer
    from trainer.recipes import rloo

    torch.manual_seed(0)
    model = Transformer(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=90, max_seq_len=64,
                        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    model.init_buffers()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 89, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 9, (6,), generator=gen)]
    completions = [torch.randint(0, 89, (int(n),), generator=gen).tolist()
                   for n in torch.randint(1, 12, (6,), generator=gen)]
    adv = torch.randn(6, generator=gen)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    width = -(-(max(lengths) - 1) // multiple) * multiple  # the inputs' (the last token predicts nothing)
    results = {}
    for way in ("max_length", "longest", "padding_free"):
        # max_length: the rows as `rows` makes them, padded to the longest of the generation batch
        micros, mask, real = grpo.micro_rows(prompts, completions, 89, way, 2, multiple)
        assert real == sum(min(n, width) for n in lengths) and mask.shape == (6, width)
        assert all((m.documents is not None) == (way == "padding_free") for m in micros)
        logps = [grpo.token_logps(model, m, chunked.token_logps) for m in micros]
        old = [lp.detach() + 0.1 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(2)) for lp in logps]
        losses = [grpo.grpo_loss(lp, o, a, k, 0.2, beta=0.04, ref_logps=o, accum=2, tokens_per_rank=mask.sum())[0]
                  + rloo.rloo_loss(lp, o, a, k, 0.2)[0]
                  for lp, o, a, k in zip(logps, old, adv.chunk(2), mask.chunk(2), strict=True)]
        loss = sum(losses)
        results[way] = torch.cat(logps), loss, torch.autograd.grad(loss, list(model.parameters()))
    assert (results["max_length"][0] != 0).sum() == sum(len(c) for c in completions)
    for way in ("longest", "padding_free"):
        torch.testing.assert_close(results[way][0], results["max_length"][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[way][1], results["max_length"][1], rtol=1e-5, atol=1e-6)
        for g, e in zip(results[way][2], results["max_length"][2], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
