"""`recipe=reward` on `data=preference`: the Bradley-Terry loss is TRL 1.16's (its RewardTrainer.compute_loss
called on generated scores), a tiny model learns a toy preference, `python -m trainer.export` writes it as a
*ForSequenceClassification that transformers loads with the same scores, and recipe=grpo scores completions with
it through recipe.reward_model.path beside a reward function."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import compose_refused, examples, read_metrics
from tests.trainer.recipes.test_dpo import preference_setup  # noqa: F401 (a fixture)
from tests.trainer.recipes.test_grpo import REWARDS_ON_PATH, TOY, prompts  # noqa: F401 (a fixture)
from trainer import export
from trainer.models import score
from trainer.recipes import reward

pytestmark = pytest.mark.timeout(300)


def _trl_loss(chosen, rejected, center_rewards_coefficient):
    """TRL's own `RewardTrainer.compute_loss`, on a stand-in trainer whose model gives the scores."""
    from trl.trainer.reward_trainer import RewardTrainer

    same = SimpleNamespace(gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=same, _total_train_tokens=0,
                              _tp_size=1, _metrics={"train": defaultdict(list)},
                              args=SimpleNamespace(center_rewards_coefficient=center_rewards_coefficient))
    logits = torch.cat([chosen, rejected])[:, None]
    inputs = {"attention_mask": torch.ones(len(logits), 3, dtype=torch.long)}
    loss = RewardTrainer.compute_loss(trainer, lambda **_: SimpleNamespace(logits=logits), inputs)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@settings(max_examples=examples(30))
@given(pairs=st.integers(1, 6), center=st.sampled_from([None, 0.01, 0.5]), seed=st.integers(0, 2**16))
def test_the_loss_and_its_gradient_are_trls(pairs, center, seed):
    gen = torch.Generator().manual_seed(seed)
    chosen, rejected = (torch.randn(pairs, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    loss, stats = reward.reward_loss(chosen, rejected, center)
    theirs, their_stats = _trl_loss(chosen, rejected, center)
    torch.testing.assert_close(loss, theirs, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, [chosen, rejected]),
                               torch.autograd.grad(theirs, [chosen, rejected]), rtol=1e-9, atol=1e-12)
    for key in reward.METRICS:
        assert float(stats[key]) == pytest.approx(their_stats[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("multiple", [1, 4])
def test_every_packing_gives_the_scores_loss_and_gradient_of_the_padded_pairs(multiple):
    """data.packing: the conversations of padded preference rows padded to the longest one or packed into one row
    (each a document, scored at its own last token that is not padding) give the scores, loss and gradient of the
    rows as stored; a conversation whose real tokens end in the padding id is scored before them, as transformers
    scores it."""
    from trainer.models.llama import Transformer

    torch.manual_seed(0)
    model = score.attach(Transformer(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=90,
                                     max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False))
    model.init_buffers()
    gen, seq, pad, pairs = torch.Generator().manual_seed(1), 12, 89, 5
    tokens = torch.full((pairs, 2 * (seq + 1)), pad)
    lengths = torch.randint(2, seq + 2, (pairs, 2), generator=gen)
    for row in range(pairs):
        for half in range(2):
            n, at = int(lengths[row, half]), half * (seq + 1)
            tokens[row, at : at + n] = torch.randint(0, 89, (n,), generator=gen)
    tokens[0, int(lengths[0, 0]) - 1] = pad  # the chosen conversation's last real token is the padding id
    results = {}
    for way in ("max_length", "longest", "padding_free"):
        micro = reward.collate_pairs(tokens, lengths, pad, way, multiple)
        assert (micro.documents is not None) == (way == "padding_free")
        chosen, rejected = reward.pair_scores(model, micro, pad)
        loss, _ = reward.reward_loss(chosen, rejected, 0.01)
        results[way] = (torch.cat([chosen, rejected]), loss, torch.autograd.grad(loss, list(model.parameters())))
    assert results["max_length"][0].shape == (2 * pairs,)
    for way in ("longest", "padding_free"):
        torch.testing.assert_close(results[way][0], results["max_length"][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[way][1], results["max_length"][1], rtol=1e-5, atol=1e-6)
        for g, e in zip(results[way][2], results["max_length"][2], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(600)
@pytest.mark.e2e
def test_a_reward_model_learns_a_toy_preference_and_scores_in_transformers_and_grpo(
        preference_setup, prompts, run_cli, tmp_path):  # noqa: F811
    from transformers import AutoModelForSequenceClassification

    model, pairs = preference_setup
    run = tmp_path / "run"
    args = ["model=hf", f"model.path={model}", "recipe=reward", "data=preference", f"data.path={pairs}",
            "data.seq_len=40", "data.eval_percent=20", "train.global_batch_size=4", "train.progress=false",
            "train.log_every=1", "lr_schedule.warmup_steps=0", "optim.lr=3e-3", "train.max_steps=8",
            "train.eval_every=8"]
    proc = run_cli(*args, "train.checkpoint_every=8", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(str(run))
    assert lines[-1]["accuracy"] == 1.0 and lines[-1]["eval_accuracy"] == 1.0
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.3 and lines[-1]["margin"] > 1
    # The rows packed without padding (data.packing unset) score as padded to data.seq_len: the first
    # two steps (the learning rate is the peak's at both, whatever train.max_steps).
    proc = run_cli(*args, "data.packing=max_length", "train.max_steps=2", f"hydra.run.dir={tmp_path / 'padded'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    padded = read_metrics(str(tmp_path / "padded"))
    for key in ("loss", "margin", "tokens"):
        assert [m[key] for m in padded] == pytest.approx([m[key] for m in lines[:2]], abs=1e-5), key

    out = str(tmp_path / "scorer")
    assert run_cli(str(run / "checkpoints" / "step-8"), out, module="trainer.export").returncode == 0
    theirs = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ours = export.load_model(str(run / "checkpoints" / "step-8"), export.run_config(str(run / "checkpoints" /
                                                                                          "step-8"))).eval()
    from trainer.data.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(model)
    texts = [[{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": answer}]
             for answer in ("I am fine, thank you.", "def main(): return 42")]
    ids = [tok.apply_chat_template(t, "assistant")[0] for t in texts]  # as data=preference encodes a row
    pad = theirs.config.pad_token_id
    width = max(len(i) for i in ids)
    tokens = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
    with torch.no_grad():
        hf_scores = theirs(input_ids=tokens, attention_mask=(tokens != pad).long()).logits[:, 0]
        our_scores = score.scores(ours, tokens, pad)
    torch.testing.assert_close(hf_scores, our_scores, rtol=1e-5, atol=1e-5)
    assert hf_scores[0] > hf_scores[1]  # the preference holds on a prompt it never saw

    grpo = tmp_path / "grpo"
    proc = run_cli("model=hf", f"model.path={model}", "recipe=grpo", "data=prompts", f"data.path={prompts}",
                   "data.seq_len=16", "data.eval_percent=20", "recipe.num_generations=4",
                   "train.global_batch_size=8", "recipe.max_completion_length=8", "train.max_steps=2",
                   "train.eval_every=2", "train.progress=false", "train.log_every=1", f"recipe.reward_funcs=[{TOY}]",
                   f"recipe.reward_model.path={out}", "recipe.reward_weights=[1.0,0.5]", f"hydra.run.dir={grpo}",
                   env=REWARDS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for m in read_metrics(str(grpo)):
        assert m["reward"] == pytest.approx(m["rewards/lowercase/mean"] + 0.5 * m["rewards/scorer/mean"], rel=1e-5)
        assert m["rewards/scorer/std"] > 0


def test_reward_runs_that_cannot_train_are_refused(preference_setup, prompts, tmp_path, capsys):  # noqa: F811
    model, pairs = preference_setup
    base = ["model=hf", f"model.path={model}", "data.seq_len=40", "train.global_batch_size=4"]
    assert "recipe=reward trains on data=preference" in compose_refused(tmp_path, capsys, *base, "recipe=reward")
    assert "peft=lora would leave frozen" in compose_refused(
        tmp_path, capsys, *base, "recipe=reward", "data=preference", f"data.path={pairs}", "peft=lora")
    assert "must hold a *ForSequenceClassification model with one label" in compose_refused(
        tmp_path, capsys, *base, "recipe=grpo", "data=prompts", f"data.path={prompts}", "data.seq_len=16",
        "recipe.num_generations=4", f"recipe.reward_model.path={model}")
    assert "must give one weight per reward function (1) and one for recipe.reward_model" in compose_refused(
        tmp_path, capsys, *base, "recipe=grpo", "data=prompts", f"data.path={prompts}", f"recipe.reward_funcs=[{TOY}]",
        f"recipe.reward_model.path={model}", "recipe.reward_weights=[1.0]")
