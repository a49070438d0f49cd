"""`recipe=dpo` on `data=preference`: the loss and its gradient are the paper's formula, and on a tiny
preference set the reward margin grows, also under tensor parallelism (2 CPU processes, real torchrun and
gloo). The model and tokenizer are tiny ones made here."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import compose_refused, examples, read_metrics
from tests.trainer.hf_models import SAMPLE, add_tokenizer, make_llama
from trainer.recipes import dpo
from trainer.recipes.sft import IGNORE

pytestmark = pytest.mark.timeout(300)
logps = st.lists(st.floats(-60, -0.01), min_size=4, max_size=4)


@settings(max_examples=examples(40))
@given(logps, logps, logps, logps, st.floats(0.01, 2.0))
def test_loss_and_gradient_are_the_papers_formula(pc, pr, rc, rr, beta):
    policy_chosen = torch.tensor(pc, dtype=torch.float64, requires_grad=True)
    policy_rejected = torch.tensor(pr, dtype=torch.float64, requires_grad=True)
    loss, stats = dpo.dpo_loss(
        policy_chosen,
        policy_rejected,
        torch.tensor(rc, dtype=torch.float64),
        torch.tensor(rr, dtype=torch.float64),
        beta,
    )
    z = [beta * ((a - c) - (b - d)) for a, b, c, d in zip(pc, pr, rc, rr, strict=True)]
    # -log sigmoid(z) = log(1 + e^-z); its derivative in z is -sigmoid(-z).
    assert float(loss.detach()) == pytest.approx(sum(math.log1p(math.exp(-x)) for x in z) / 4, rel=1e-9, abs=1e-12)
    loss.backward()
    slope = [1 / (1 + math.exp(x)) for x in z]
    assert policy_chosen.grad.tolist() == pytest.approx([-beta * s / 4 for s in slope], rel=1e-9, abs=1e-15)
    assert policy_rejected.grad.tolist() == pytest.approx([beta * s / 4 for s in slope], rel=1e-9, abs=1e-15)
    assert float(stats["rewards/margins"]) == pytest.approx(sum(z) / 4, rel=1e-9, abs=1e-12)
    assert float(stats["rewards/accuracies"]) == sum(x > 0 for x in z) / 4


def test_sequence_logps_sum_the_counted_tokens():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([[1, 2, IGNORE, 4, IGNORE], [IGNORE, IGNORE, 6, 0, 3]])
    expected = [
        sum(torch.log_softmax(logits[b, t], -1)[target[b, t]] for t in range(5) if target[b, t] != IGNORE)
        for b in range(2)
    ]
    torch.testing.assert_close(dpo.sequence_logps(logits, target), torch.stack(expected))


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
    "optim.warmup_steps=0",
    "optim.lr=1e-2",
]


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
    assert "final train loss (no eval split)" in proc.stdout
    assert [m["step"] for m in read_metrics(str(tmp_path / "run"))] == [1, 2]
    assert [m.get("eval_loss") for m in read_metrics(str(tmp_path / "run"))] == [None, None]
    # An explicit share that leaves the eval split too small is still refused, in one line.
    refused = run_cli(*args, "data.eval_percent=0.5", f"hydra.run.dir={tmp_path / 'explicit'}")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "data.eval_percent=0.5: leaves the eval split no rows" in refused.stderr


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


def test_preference_runs_that_cannot_train_are_refused(preference_setup, tmp_path, capsys):
    model, path = preference_setup
    hf = ["model=hf", f"model.path={model}"]
    assert "data='stdlib': recipe=dpo trains on data=preference" in compose_refused(tmp_path, capsys, *hf, "recipe=dpo")
    assert "recipe.beta=0.0: must be > 0" in compose_refused(
        tmp_path, capsys, *hf, *ARGS, f"data.path={path}", "recipe.beta=0"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "chosen": "yes"}) + "\n")
    err = compose_refused(tmp_path, capsys, *hf, *ARGS, f"data.path={bad}")
    assert f"row 1 of {bad} needs the strings prompt, chosen, rejected" in err
