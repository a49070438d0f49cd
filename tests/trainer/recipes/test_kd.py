"""`recipe=kd`: the chunked distillation loss and its gradient are TRL GKD's `generalized_jsd_loss` (forward KL,
reverse KL, JSD; transcribed from trl/trainer/gkd_trainer.py, 1.x) mixed with the cross-entropy, for any chunk
size; a tiny Llama student distilled from a tiny Qwen2 teacher (same tokenizer) on data=chat gets closer to it
(its KL to the teacher falls); a teacher with another vocabulary is refused in one line."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import compose_refused, examples, read_metrics
from tests.trainer.hf_models import SAMPLE, add_tokenizer, make_llama, make_qwen2
from trainer.recipes import kd
from trainer.recipes.sft import IGNORE

pytestmark = pytest.mark.timeout(300)


def _trl_generalized_jsd(student_logits, teacher_logits, labels, beta, temperature):
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture = torch.logsumexp(torch.stack([student_log_probs + torch.log(1 - beta),
                                               teacher_log_probs + torch.log(beta)]), dim=0)
        jsd = beta * F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True) + (1 - beta) * F.kl_div(
            mixture, student_log_probs, reduction="none", log_target=True)
    mask = labels != IGNORE
    return jsd[mask].sum() / mask.sum()


BETA = {"forward_kl": 0, "reverse_kl": 1, "jsd": 0.5}


@settings(max_examples=examples(25))
@given(st.sampled_from(sorted(BETA)), st.floats(0.5, 3.0), st.floats(0, 1), st.integers(1, 7), st.integers(1, 3),
       st.integers(2, 6), st.integers(0, 2**16))
def test_the_chunked_loss_and_its_gradient_are_trls_formula(loss, temperature, alpha, chunk, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    dim, vocab = 8, 11
    h_s = torch.randn(batch, seq, dim, generator=g, dtype=torch.float64, requires_grad=True)
    w_s = torch.randn(vocab, dim, generator=g, dtype=torch.float64, requires_grad=True)
    h_t, w_t = torch.randn(batch, seq, dim, generator=g, dtype=torch.float64), torch.randn(vocab, dim, generator=g,
                                                                                          dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < 0.3] = IGNORE
    labels[0, 0] = 1  # at least one counted token
    got, stats = kd.kd_loss(h_s, w_s, h_t, w_t, labels, loss, temperature, alpha, chunk_tokens=chunk)
    student, teacher = h_s @ w_s.T, h_t @ w_t.T
    ce = F.cross_entropy(student.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    div = _trl_generalized_jsd(student, teacher, labels, BETA[loss], temperature) * temperature**2
    expected = alpha * div + (1 - alpha) * ce
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats["kd/divergence"].double(), div.detach(), rtol=1e-5, atol=1e-7)
    mine = torch.autograd.grad(got, (h_s, w_s))
    theirs = torch.autograd.grad(expected, (h_s, w_s))
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("kd"))
    student, teacher = add_tokenizer(make_llama(root)), add_tokenizer(make_qwen2(root))
    rng = random.Random(0)
    chats = os.path.join(root, "chats.jsonl")
    with open(chats, "w") as f:
        for _ in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": rng.choice(SAMPLE)[:20]},
                                             {"role": "assistant", "content": rng.choice(SAMPLE)}]}) + "\n")
    return student, teacher, chats


ARGS = ["recipe=kd", "data=chat", "data.seq_len=48", "data.eval_percent=20", "train.global_batch_size=4",
        "train.progress=false", "train.log_every=1", "lr_schedule.warmup_steps=0", "optim.lr=1e-2",
        "recipe.kd.chunk_tokens=16"]


def test_the_students_kl_to_the_teacher_falls(models, run_cli, tmp_path):
    student, teacher, chats = models
    proc = run_cli("model=hf", f"model.path={student}", f"recipe.teacher.path={teacher}", f"data.path={chats}",
                   *ARGS, "recipe.kd.alpha=1.0", "train.max_steps=8", "train.eval_every=8",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(str(tmp_path / "run"))
    kl = [m["kd/divergence"] for m in lines]
    assert kl[-1] < 0.6 * kl[0], kl
    assert all(m["loss"] == pytest.approx(m["kd/divergence"], rel=1e-5) for m in lines)  # alpha = 1
    assert lines[-1]["eval_loss"] < kl[0]


def test_a_teacher_that_cannot_teach_is_refused(models, tmp_path, capsys):
    student, teacher, chats = models
    other = tmp_path / "other-vocab"
    shutil.copytree(teacher, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 400}))
    base = ["model=hf", f"model.path={student}", f"data.path={chats}", *ARGS]
    err = compose_refused(tmp_path, capsys, *base, f"recipe.teacher.path={other}")
    assert "the teacher has a vocabulary of 400 tokens, the student model.vocab_size=320" in err
    assert "recipe=kd needs the teacher's Hugging Face model directory" in compose_refused(tmp_path, capsys, *base)


def test_a_teacher_that_cannot_load_is_one_line_naming_its_file(models, run_cli, tmp_path):
    student, teacher, chats = models
    cut, garbage = tmp_path / "cut", tmp_path / "garbage"
    for broken in (cut, garbage):
        shutil.copytree(teacher, broken)
    weights = next(cut.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (garbage / "config.json").write_text("{not json")
    base = ["model=hf", f"model.path={student}", f"data.path={chats}", *ARGS, "train.max_steps=1"]
    for broken, named in ((cut, weights), (garbage, garbage / "config.json")):
        proc = run_cli(*base, f"recipe.teacher.path={broken}", f"hydra.run.dir={tmp_path / broken.name / 'run'}")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert lines[0].startswith("error: invalid config: recipe.teacher.path=") and str(named) in lines[0], lines
        assert not (tmp_path / broken.name / "run").exists()
