"""`recipe=ppo` on `data=prompts`: its numbers against TRL's PPOTrainer's own code (TRL 0.28, the last release that
ships it, from its own virtualenv: `tests.trainer.trl_ppo_reference`): the rollout's KL penalty, rewards, GAE and
whitening exactly, the loss and its gradients to 1e-5, PPOConfig's defaults; the log-probabilities and entropy a
chunk of logits at a time against the whole logits; the value head on the policy; what cannot run refused in one
line; and, end to end (e2e), a LoRA run on two ranks (torchrun, gloo) under ddp and fsdp2 that raises the mean
reward of a one-token reward over 30 steps, its value model's explained variance above 0 at the end, its export
loaded by transformers; under tp on two ranks, both value models, the steps of one process."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.conftest import REPO, TINY, compose_refused, read_metrics
from tests.trainer import trl_ppo_reference as trl
from tests.trainer.hf_models import add_tokenizer, make_llama, make_llama_scorer
from trainer.config.compose import compose
from trainer.config.recipe import RecipeConfig
from trainer.models import chunked
from trainer.recipes import ppo

pytestmark = pytest.mark.timeout(600)
needs_trl = pytest.mark.skipif(trl.source_dir() is None, reason=trl.missing())

ONE_TOKEN = "tests.trainer.ppo_rewards:count_e"
ON_PATH = {"PYTHONPATH": REPO}  # where a user's reward module must be: importable by the ranks
ARGS = [*[a for a in TINY if not a.startswith(("data.seq_len", "train.global_batch_size", "model."))], "recipe=ppo",
        "data=prompts", "data.seq_len=16", "data.eval_percent=20", "lr_schedule.warmup_steps=0",
        "recipe.max_completion_length=8", f"recipe.reward_funcs=[{ONE_TOKEN}]"]


def _prompts(tmp_path_factory, name: str, count: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "sun", "sky"]
    path = tmp_path_factory.mktemp("prompts") / name
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(3))}) + "\n"
                            for _ in range(count)))
    return str(path)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    return _prompts(tmp_path_factory, "prompts.jsonl", 160, seed=0)


@pytest.fixture(scope="module")
def many_prompts(tmp_path_factory) -> str:
    """Prompts for 64 a step, and an eval split of 64 at data.eval_percent=20."""
    return _prompts(tmp_path_factory, "many.jsonl", 400, seed=1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return add_tokenizer(make_llama(str(tmp_path_factory.mktemp("models"))))


def _rollout_batch(seed: int, n: int = 6, width: int = 7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    lengths[0] = width  # one completion as long as the table: its score at T - 1
    logps = -torch.rand(n, width, generator=gen) * 3
    ref = logps + torch.randn(n, width, generator=gen) * 0.3
    values = torch.randn(n, width, generator=gen)
    scores = torch.randn(n, generator=gen) * 2
    return logps, ref, values, scores, lengths


@needs_trl
@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize("gamma, lam, seed", [(1.0, 0.95, 0), (0.9, 0.8, 1)])
def test_the_rollouts_kl_rewards_gae_and_whitening_are_trls_exactly(kl_estimator, whiten_rewards, gamma, lam, seed):
    logps, ref, values, scores, lengths = _rollout_batch(seed)
    args = {"kl_estimator": kl_estimator, "kl_coef": 0.05, "whiten_rewards": whiten_rewards, "gamma": gamma,
            "lam": lam}
    theirs = trl.rollout(logps.clone(), ref.clone(), values.clone(), scores, lengths, **args)
    r = RecipeConfig(name="ppo", **args)
    advantages, returns, stats = ppo.rollout_targets(logps, ref, values, scores, lengths, r)
    assert torch.equal(advantages, theirs["advantages"])
    assert torch.equal(returns, theirs["returns"])
    assert torch.equal(stats["objective/kl"], theirs["kl"].sum(1).mean())
    assert torch.equal(stats["objective/non_score_reward"], theirs["non_score_reward"].sum(1).mean())
    assert torch.equal(~theirs["padding_mask"], torch.arange(7)[None] < lengths[:, None])  # the counted positions
    assert torch.equal(~theirs["padding_mask_p1"], torch.arange(7)[None] <= lengths[:, None])  # the values'


@needs_trl
@pytest.mark.parametrize("seed, cliprange, cliprange_value, vf_coef", [(0, 0.2, 0.2, 0.1), (1, 0.05, 0.01, 0.5)])
def test_the_loss_and_its_gradients_are_trls(seed, cliprange, cliprange_value, vf_coef):
    """TRL's loss block on the same micro-batch: the loss, the policy's and the value's gradients (1e-5), and the
    statistics TRL logs of it."""
    old, ref, old_values, scores, lengths = _rollout_batch(seed)
    r = RecipeConfig(name="ppo")
    advantages, returns, _ = ppo.rollout_targets(old, ref, old_values, scores, lengths, r)
    gen = torch.Generator().manual_seed(seed + 10)
    new = (old + torch.randn(old.shape, generator=gen) * 0.3).requires_grad_()
    values = (old_values + torch.randn(old.shape, generator=gen) * 0.3).requires_grad_()
    index = torch.arange(old.shape[1])[None]
    mask, vmask = index < lengths[:, None], index <= lengths[:, None]
    settings = {"cliprange": cliprange, "cliprange_value": cliprange_value, "vf_coef": vf_coef}
    loss, stats = ppo.ppo_loss(new, values, old, old_values * vmask, advantages, returns, mask, vmask, **settings)
    ours = torch.autograd.grad(loss, (new, values))
    theirs = trl.loss(torch.masked_fill(new, ~mask, trl.INVALID_LOGPROB),
                      torch.masked_fill(values, ~vmask, 0), torch.masked_fill(old, ~mask, trl.INVALID_LOGPROB),
                      old_values * vmask, advantages, returns, ~mask, ~vmask, **settings)
    expected = torch.autograd.grad(theirs["loss"], (new, values))
    assert loss.item() == pytest.approx(theirs["loss"].item(), rel=1e-5, abs=1e-7)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for key, name in (("loss/policy_avg", "pg_loss"), ("loss/value_avg", "vf_loss"), ("val/ratio", "ratio"),
                      ("policy/clipfrac_avg", "pg_clipfrac"), ("val/clipfrac_avg", "vf_clipfrac"),
                      ("policy/approxkl_avg", "approxkl")):
        want = theirs[name].mean() if name == "ratio" else theirs[name]
        assert stats[key].item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7), key
    assert 0 < stats["policy/clipfrac_avg"] < 1 and stats["val/clipfrac_avg"] > 0  # each clipping counted


@needs_trl
def test_the_defaults_are_trls_ppoconfigs():
    theirs = trl.config_defaults()
    recipe = compose(["recipe=ppo"]).recipe
    same = ("num_ppo_epochs", "num_mini_batches", "whiten_rewards", "kl_coef", "kl_estimator", "cliprange", "vf_coef",
            "cliprange_value", "gamma", "lam", "missing_eos_penalty", "temperature")
    for key in same:
        assert recipe[key] == theirs[key], key
    assert recipe.max_completion_length == theirs["response_length"]
    assert recipe.value_model == "separate"  # TRL's PPOTrainer takes a value model of its own


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probabilities_and_entropy_a_chunk_at_a_time_are_the_whole_logits(temperature):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (2, 9), generator=gen)
    targets[0, :3] = chunked.IGNORE
    logps, entropy = chunked.token_logps_entropy(hidden, weight, targets, temperature, chunk_tokens=4)
    logits = (hidden @ weight.T) / temperature
    whole = torch.log_softmax(logits, -1)
    counted = targets != chunked.IGNORE
    want = whole.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * counted
    torch.testing.assert_close(logps, want)
    torch.testing.assert_close(entropy, -(whole.exp() * whole).sum(-1).detach() * counted)
    grads = torch.autograd.grad(logps.sum(), (hidden, weight))
    for got, expected in zip(grads, torch.autograd.grad(want.sum(), (hidden, weight)), strict=True):
        torch.testing.assert_close(got, expected)


def test_the_score_goes_after_the_last_token_and_gae_discounts_it():
    kl = torch.zeros(2, 3)
    rewards, _ = ppo.token_rewards(kl, torch.tensor([1.0, 2.0]), torch.tensor([1, 3]), 0.05)
    assert rewards.tolist() == [[0, 1, 0], [0, 0, 2]]  # at L, or L - 1 when L is the table's width
    _, returns = ppo.gae(rewards, torch.zeros(2, 3), gamma=0.5, lam=1.0)
    assert returns.tolist() == [[0.5, 1, 0], [0.5, 1, 2]]


def test_runs_that_cannot_train_are_refused(prompts, tmp_path, capsys):
    err = compose_refused(tmp_path, capsys, *[a for a in ARGS if a != "data=prompts"])
    assert "recipe=ppo trains on data=prompts" in err and len(err.strip().splitlines()) == 1, err
    base = [*ARGS, f"data.path={prompts}"]
    cases = [
        (["recipe.kl_estimator=k2"], "recipe.kl_estimator"),
        (["recipe.value_model=head"], "recipe.value_model"),
        (["recipe.gamma=1.5"], "recipe.gamma"),
        (["recipe.missing_eos_penalty=-1"], "recipe.missing_eos_penalty"),
        (["recipe.num_generations=4"], "recipe.num_generations"),
        (["recipe.reward_funcs=[]"], "needs at least one reward function"),
        (["strategy=deepspeed", "+runtime=torch-distributed", "runtime.nproc_per_node=2"],
         "strategy.data_parallel"),
    ]
    for extra, message in cases:
        err = compose_refused(tmp_path, capsys, *base, *extra)
        assert message in err, (extra, err)
        assert len(err.strip().splitlines()) == 1, err


def test_a_value_head_on_the_policy_trains_beside_its_adapters_and_stays_out_of_the_export(prompts, llama, run_cli,
                                                                                           tmp_path):
    run, out = tmp_path / "run", tmp_path / "export"
    proc = run_cli(*ARGS, "model=hf", f"model.path={llama}", "peft=lora", f"data.path={prompts}",
                   "recipe.value_model=shared", "train.global_batch_size=8", "recipe.num_mini_batches=2",
                   "recipe.num_ppo_epochs=2", "train.max_steps=4", "train.eval_every=4", f"hydra.run.dir={run}",
                   env=ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(str(run))
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        for key in ppo.METRICS:
            assert key in m, key
    # Four steps on one rollout (2 epochs x 2 mini-batches): the same scores; the first step is on policy.
    assert len({m["objective/scores"] for m in lines}) == 1
    assert lines[0]["objective/kl"] == 0 and lines[0]["val/ratio"] == pytest.approx(1, abs=1e-6)
    assert lines[-1]["val/ratio"] != pytest.approx(1, abs=1e-6)
    proc = run_cli(f"{run}/checkpoints/step-4", str(out), "--merge", module="trainer.export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("value" in name for name, _ in model.named_parameters())


@pytest.mark.e2e
def test_a_run_resumes_with_its_value_model(prompts, run_cli, tmp_path):
    """The value model is kept in the policy's checkpoint: a resumed run loads it (and the input checks take its
    tensors beside the policy's)."""
    run = tmp_path / "run"
    args = [*ARGS, "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
            f"data.path={prompts}", "train.global_batch_size=8", "recipe.num_ppo_epochs=1",
            "train.checkpoint_every=2", "train.eval_every=100", f"hydra.run.dir={run}"]
    first = run_cli(*args, "train.max_steps=2", env=ON_PATH)
    assert first.returncode == 0, first.stderr[-2000:]
    proc = run_cli(*args, "train.max_steps=4", env=ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(str(run))] == [1, 2, 3, 4]
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(run / "checkpoints" / "step-4")).read_metadata().state_dict_metadata
    assert any(k.startswith("model.value_model.") for k in saved)


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp2", marks=pytest.mark.extended)])
def test_lora_on_two_ranks_raises_the_reward_and_exports(strategy, many_prompts, llama, run_cli, tmp_path):
    """A one-token reward (the count of "e", which 12 of the tiny Llama's 320 tokens hold) at TRL's PPO defaults
    (4 epochs of one mini-batch a rollout, kl_coef 0.05, temperature 0.7, cliprange 0.2, vf_coef 0.1) and the
    blueprint's 64 completions a rollout (conf/experiment/qwen2_5_1_5b_ppo.yaml); the learning rate LoRA's on a
    tiny model. The untrained policy is nearly uniform (entropy 5.7 nats of log 320 = 5.8): with 16 completions a
    rollout it samples ~5 tokens holding an "e", which the whitened advantages of the other ~120 tokens drown, and
    30 steps at 4 epochs are 8 rollouts, each moving the policy no further than the clipped ratio lets it (4 epochs
    learn little more per rollout than 1). 64 completions a rollout: the mean count rose from 0.30 over the first 8
    steps to 0.45 over the last 8 (ddp; one process at temperature 1: 0.21 to 0.37)."""
    run, out = tmp_path / "run", tmp_path / "export"
    proc = run_cli(*ARGS, "model=hf", f"model.path={llama}", "peft=lora", f"data.path={many_prompts}",
                   "train.global_batch_size=64", "optim.lr=1e-2", "train.max_steps=30", "train.eval_every=30",
                   f"strategy={strategy}", "+runtime=torch-distributed", "runtime.nproc_per_node=2",
                   f"hydra.run.dir={run}", env={"PYTHONPATH": REPO}, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(str(run))
    assert len(lines) == 30
    first = sum(m["rewards/count_e/mean"] for m in lines[:8]) / 8
    last = sum(m["rewards/count_e/mean"] for m in lines[-8:]) / 8
    print(f"{strategy}: mean count of e, first 8 steps {first:.3f}, last 8 {last:.3f}; explained variance "
          f"{[round(m['val/explained_variance'], 3) for m in lines[::4]]}")
    assert last > first + 0.08, (first, last)
    assert lines[-1]["val/explained_variance"] > 0
    proc = run_cli(f"{run}/checkpoints/step-30", str(out), "--merge", module="trainer.export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("value" in name or "score" in name for name, _ in model.named_parameters())
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 320)


# The metrics a tp run's steps match one process's in. Measured (float32 on CPUs, 4 steps of one rollout): at most
# 5.1e-6 apart (grad_norm 1.56, relative 3.3e-6), and 3.7e-7 where a value is near 0 (a step's loss of 6e-4, its
# policy and value losses cancelling: relative 2.3e-4), so 2e-5 relative or 1e-6 absolute.
TP_SAME = ("loss", "grad_norm", "loss/policy_avg", "loss/value_avg", "policy/entropy_avg", "objective/entropy",
           "objective/scores", "val/explained_variance", "policy/clipfrac_avg", "val/ratio")


@pytest.fixture(scope="module")
def scorer(tmp_path_factory) -> str:
    return make_llama_scorer(str(tmp_path_factory.mktemp("scorer")))


@pytest.mark.e2e
@pytest.mark.parametrize("value_model, peft", [("separate", "none"), ("shared", "lora")])
def test_under_tensor_parallelism_the_steps_are_one_processs(value_model, peft, prompts, llama, scorer, run_cli,
                                                             tmp_path):
    """strategy=tp on two ranks (the vocabulary split: log-probabilities and entropy from its shards; the value
    model's score head or the policy's value head whole on each rank, on the sequence-split hidden states): the
    same rollout and the same four steps (2 epochs x 2 mini-batches) as one process. The separate value model
    starts from a reward model, which scores the completions too."""
    scored = [f"recipe.reward_model.path={scorer}"] if value_model == "separate" else []
    args = [*ARGS, "model=hf", f"model.path={llama}", f"peft={peft}", f"data.path={prompts}", *scored,
            f"recipe.value_model={value_model}", "train.global_batch_size=8", "recipe.num_mini_batches=2",
            "recipe.num_ppo_epochs=2", "train.max_steps=4", "train.eval_every=100"]
    runs = {}
    for name, extra in (("one", []), ("tp", ["strategy=tp", "+runtime=torch-distributed", "runtime.nproc_per_node=2"])):
        proc = run_cli(*args, *extra, f"hydra.run.dir={tmp_path / name}", env=ON_PATH)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = read_metrics(str(tmp_path / name))
    assert [m["step"] for m in runs["tp"]] == [1, 2, 3, 4]
    assert runs["one"][0]["reward_std"] > 0  # completions scored apart: advantages not all 0
    for key in (*TP_SAME, "rewards/llama-scorer/mean") if scored else TP_SAME:
        got, want = [m[key] for m in runs["tp"]], [m[key] for m in runs["one"]]
        apart = [abs(g - w) for g, w in zip(got, want, strict=True)]
        print(f"{value_model}: {key} difference {max(apart):.1e}, relative "
              f"{max(a / max(abs(w), 1e-12) for a, w in zip(apart, want, strict=True)):.1e}")
        assert got == pytest.approx(want, rel=2e-5, abs=1e-6), key
