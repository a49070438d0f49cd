"""`recipe=dpo` on `data=preference`: the loss of each loss type, its gradient and its rewards are TRL 1.16's own,
and on a tiny preference set the reward margin grows, also under tensor parallelism (2 CPU processes, real
torchrun and gloo). The model and tokenizer are tiny ones made here."""

from __future__ import annotations

import copy
import json
import math
import random
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import compose_refused, examples, read_metrics, read_summary
from tests.trainer import trl_reference
from tests.trainer.hf_models import SAMPLE, add_tokenizer, make_llama
from trainer.data import packing
from trainer.recipes import dpo
from trainer.recipes.sft import IGNORE

pytestmark = pytest.mark.timeout(300)


class _Model:
    """A policy whose forward gives the given per-token log-probabilities where the targets count (what the
    model's `loss_fn=chunked.token_logps` returns; chunked.token_logps itself is checked in test_chunked.py)."""

    def __init__(self, logps: torch.Tensor):
        self.logps = logps

    def __call__(self, inputs, target, documents, loss_fn):
        assert inputs.shape == target.shape == self.logps.shape and documents is None
        return self.logps * (target != IGNORE)


@settings(max_examples=examples(60))
@given(pairs=st.integers(1, 4), length=st.integers(2, 9), beta=st.floats(0.01, 2.0),
       loss_type=st.sampled_from(dpo.LOSS_TYPES), smoothing=st.floats(0.0, 0.49), seed=st.integers(0, 2**16))
def test_loss_gradient_and_rewards_equal_trls(pairs, length, beta, loss_type, smoothing, seed):
    """`pair_loss` on preference rows (chosen half, rejected half, each with its loss mask) against TRL 1.16's own
    `DPOTrainer._compute_loss` on the same per-token log-probabilities, for every loss type."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (pairs, 2 * length), generator=gen)
    mask = (torch.rand(pairs, 2 * length, generator=gen) < 0.6).long()
    mask[:, [0, length]] = 0  # a sequence's first token is the prompt's: never a target
    logps = (-torch.rand(2 * pairs, length - 1, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    ref = (-torch.rand(2 * pairs, length - 1, generator=gen, dtype=torch.float64) * 3)
    smoothing = smoothing if loss_type == "robust" else 0.0
    settings_ = {"beta": beta, "loss_type": loss_type, "label_smoothing": smoothing}
    loss, stats = dpo.pair_loss(_Model(logps), _Model(ref), packing.Packed(*dpo.pair_rows(tokens, mask)), settings_)
    (grad,) = torch.autograd.grad(loss, logps)
    completion = torch.cat([mask[:, :length], mask[:, length:]])
    counted = completion[:, 1:].bool()
    ref_chosen, ref_rejected = (ref * counted).sum(-1).chunk(2)
    reference, metrics = trl_reference.dpo(logps * counted, ref_chosen, ref_rejected, completion,
                                           loss_type=loss_type, beta=beta, label_smoothing=smoothing)
    (reference_grad,) = torch.autograd.grad(reference, logps)
    torch.testing.assert_close(loss, reference, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-9, atol=1e-12)
    for key in dpo.METRICS:
        assert float(stats[key]) == pytest.approx(metrics[key][0], rel=1e-6, abs=1e-9), key


@pytest.fixture(scope="module")
def preference_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    model = add_tokenizer(make_llama(str(root)))
    rng = random.Random(0)
    good, bad = "I am fine, thank you.", "def main(): return 42"
    path = root / "pairs.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": rng.choice(SAMPLE)[:30], "chosen": good, "rejected": bad}) + "\n" for _ in range(40)
        )
    )
    return model, str(path)


ARGS = [
    "recipe=dpo",
    "data=preference",
    "data.seq_len=40",
    "data.eval_percent=20",
    "train.global_batch_size=4",
    "train.progress=false",
    "train.log_every=1",
    "lr_schedule.warmup_steps=0",
    "optim.lr=1e-2",
]


@pytest.mark.e2e
def test_forty_pairs_under_the_default_eval_percent_train_without_eval_and_say_so(preference_setup, run_cli,
                                                                                  tmp_path):
    model, path = preference_setup
    args = ["model=hf", f"model.path={model}", *[a for a in ARGS if not a.startswith("data.eval_percent")],
            f"data.path={path}", "train.max_steps=2"]
    proc = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "training without eval" in line]
    assert len(said) == 1, said
    assert "data.eval_percent (unset: 2) leaves the eval split of data=preference 0 row(s)" in said[0]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("final train loss (no eval split): ") and last.endswith(" nats/token after 2 steps")
    written = [(tmp_path / "run" / name).read_text() for name in ("metrics.jsonl", "summary.json")]
    assert not re.search(r"\bnan\b", "\n".join([proc.stdout, proc.stderr, *written]), re.IGNORECASE)
    assert read_summary(str(tmp_path / "run"))["final_eval_loss"] is None
    assert [m["step"] for m in read_metrics(str(tmp_path / "run"))] == [1, 2]
    assert [m.get("eval_loss") for m in read_metrics(str(tmp_path / "run"))] == [None, None]
    # An explicit share that leaves the eval split too small is still refused, in one line.
    refused = run_cli(*args, "data.eval_percent=0.5", f"hydra.run.dir={tmp_path / 'explicit'}")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "data.eval_percent=0.5: leaves the eval split no rows" in refused.stderr


@pytest.mark.e2e
def test_the_reward_margin_grows_on_a_tiny_preference_set(preference_setup, run_cli, tmp_path):
    model, path = preference_setup
    args = ["model=hf", f"model.path={model}", *ARGS, f"data.path={path}", "train.max_steps=6",
            "train.eval_every=6", "recipe.beta=0.5"]
    proc = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(str(tmp_path / "run"))
    margins = [m["rewards/margins"] for m in metrics]
    # Step 1 runs the starting weights, the reference itself: rewards 0, loss log 2.
    assert margins[0] == pytest.approx(0, abs=1e-5) and metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert margins[-1] > margins[2] > 0.1 and metrics[-1]["rewards/accuracies"] == 1.0
    assert metrics[-1]["loss"] < math.log(2) - 0.05
    assert metrics[-1]["rewards/chosen"] > metrics[-1]["rewards/rejected"]

    # Under tensor parallelism (2 processes, loss parallelism on: the log-probabilities come from logits
    # split over the vocabulary) the run is the same.
    proc = run_cli(*args, "+runtime=torch-distributed", "runtime.nproc_per_node=2", "strategy=tp",
                   f"hydra.run.dir={tmp_path / 'tp'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp = read_metrics(str(tmp_path / "tp"))
    for key in ("loss", "rewards/margins", "grad_norm"):
        assert [m[key] for m in tp] == pytest.approx([m[key] for m in metrics], rel=1e-4, abs=1e-6), key

    # The run above had no padding (data.packing unset: padding_free); padded to data.seq_len, the same losses.
    proc = run_cli(*args, "data.packing=max_length", f"hydra.run.dir={tmp_path / 'padded'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    padded = read_metrics(str(tmp_path / "padded"))
    assert [m["loss"] for m in padded] == pytest.approx([m["loss"] for m in metrics], abs=1e-5)
    assert [m["tokens"] for m in padded] == [m["tokens"] for m in metrics]  # real tokens either way


def test_preference_runs_that_cannot_train_are_refused(preference_setup, tmp_path, capsys):
    model, path = preference_setup
    hf = ["model=hf", f"model.path={model}"]
    assert "data='stdlib': recipe=dpo trains on data=preference" in compose_refused(tmp_path, capsys, *hf, "recipe=dpo")
    assert "recipe.beta=0.0: must be > 0" in compose_refused(
        tmp_path, capsys, *hf, *ARGS, f"data.path={path}", "recipe.beta=0"
    )
    good = [*hf, *ARGS, f"data.path={path}"]
    assert "recipe.loss_type='dapo': must be one of sigmoid, ipo, hinge, robust" in compose_refused(
        tmp_path, capsys, *good, "recipe.loss_type=dapo")
    assert ("recipe.label_smoothing=0.1: only recipe=dpo with recipe.loss_type=robust reads it"
            in compose_refused(tmp_path, capsys, *good, "recipe.label_smoothing=0.1"))
    assert "recipe.label_smoothing=0.5: must be in [0, 0.5)" in compose_refused(
        tmp_path, capsys, *good, "recipe.loss_type=robust", "recipe.label_smoothing=0.5")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "chosen": "yes"}) + "\n")
    err = compose_refused(tmp_path, capsys, *hf, *ARGS, f"data.path={bad}")
    assert (f"row 1 of {bad} is not a form data=preference reads (its columns: prompt, chosen; strings, or lists of "
            "{'role': ..., 'content': ...} messages): give prompt, chosen and rejected (explicit prompt), or chosen "
            "and rejected (implicit prompt)") in err


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_every_packing_gives_the_loss_and_gradient_of_the_padded_pairs(loss_type):
    """data.packing: the pairs of padded preference rows (`pair_rows`), padded to the longest answer or packed
    into one row (each answer a document), give `pair_loss`'s loss and gradient of the rows as stored."""
    from trainer.models.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=90, max_seq_len=64,
                        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    model.init_buffers()
    reference = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    gen, seq, pad, pairs = torch.Generator().manual_seed(1), 12, 89, 5
    tokens = torch.full((pairs, 2 * (seq + 1)), pad)
    mask, lengths = torch.zeros_like(tokens), torch.randint(3, seq + 2, (pairs, 2), generator=gen)
    for row, half in np.ndindex(pairs, 2):
        n, at = int(lengths[row, half]), half * (seq + 1)
        tokens[row, at : at + n] = torch.randint(0, 89, (n,), generator=gen)
        mask[row, at + int(torch.randint(1, n - 1, (), generator=gen)) : at + n] = 1
    settings_ = {"beta": 0.2, "loss_type": loss_type, "label_smoothing": 0.0}
    both, target = dpo.pair_rows(tokens, mask)
    real = packing.input_lengths(torch.cat([lengths[:, 0], lengths[:, 1]]), *target.shape)
    results = {}
    for way in ("max_length", "longest", "padding_free"):
        micro = packing.collate(both, target, real, way)
        assert (micro.documents is not None) == (way == "padding_free")
        loss, _ = dpo.pair_loss(model, reference, micro, settings_)
        results[way] = (loss, torch.autograd.grad(loss, list(model.parameters())))
    for way in ("longest", "padding_free"):
        torch.testing.assert_close(results[way][0], results["max_length"][0], rtol=1e-5, atol=1e-6)
        for g, e in zip(results[way][1], results["max_length"][1], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
