"""`recipe=kto` on `data=preference`: the loss of each loss type, its gradient and its metrics are TRL 1.16's own
(`KTOTrainer._compute_loss`, called on a stand-in for the trainer, with TRL's own collator making the batch and its
mismatched KL pairs); the first losses of `python -m trainer recipe=kto` are TRL's KTOTrainer's on the same model and
data; TRL's defaults; the refusals; and 2 ranks under ddp and fsdp2 (torchrun, gloo) and LoRA. The model and
tokenizer are tiny ones made here."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer

from tests.conftest import DIST, compose_refused, examples, read_metrics
from tests.trainer.hf_models import SAMPLE, add_tokenizer, make_llama
from tests.trainer.trl_reference import _Accelerator
from trainer.models import chunked
from trainer.recipes import kto
from trainer.recipes.base import Recipe

pytestmark = pytest.mark.timeout(600)
PAD = 89


def _fused(logps_of):
    """A stand-in for TRL's model with its fused LM head: `logps_of(input_ids, labels)` gives the per-token
    log-probabilities of the batch's sequences (0 where the label is -100)."""

    def model(input_ids, labels, fused_lm_head=True, **kwargs):
        logps = logps_of(input_ids, labels)
        return SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps), mean_logits=torch.zeros_like(logps))

    return model


def trl_kto(batch: dict, policy, reference, *, loss_type: str, beta: float, desirable_weight: float = 1.0,
            undesirable_weight: float = 1.0):
    """TRL 1.16's `KTOTrainer._compute_loss` on `batch` (its collator's) with `policy` and `reference` (`_fused`
    stand-ins): its loss and its metrics."""
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False, _modules={}), accelerator=_Accelerator(),
        calculate_KL=loss_type != "apo_zero_unpaired", precompute_ref_logps=False, ref_model=reference,
        loss_type=loss_type, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    trainer._compute_kl_logps = lambda model, b: KTOTrainer._compute_kl_logps(trainer, model, b)
    loss = KTOTrainer._compute_loss(trainer, policy, batch, False)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


def trl_batch(prompts, completions, labels, max_length: int, kl: bool) -> dict:
    """TRL's batch of unpaired rows: its KL completions rotated by one within the batch as `_prepare_dataset`'s
    `add_kl_completion_ids` does, collated by its `DataCollatorForUnpairedPreference`."""
    examples_ = [{"prompt_ids": p, "completion_ids": c, "label": bool(y)}
                 for p, c, y in zip(prompts, completions, labels, strict=True)]
    if kl:
        for example, shifted in zip(examples_, [completions[-1], *completions[:-1]], strict=True):
            example["KL_completion_ids"] = shifted
    return DataCollatorForUnpairedPreference(pad_token_id=PAD, max_length=max_length)(examples_)


def stored_rows(prompts, completions, labels, width: int) -> dict:
    """The batch `trainer.data.unpaired` stores for these rows (prompt, then completion cut to `width`)."""
    tokens = torch.full((len(prompts), 2 * width), PAD, dtype=torch.int32)
    lengths = torch.zeros(len(prompts), 2, dtype=torch.int32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        kept = c[:width]
        tokens[i, : len(p)], tokens[i, width : width + len(kept)] = torch.tensor(p), torch.tensor(kept)
        lengths[i] = torch.tensor([len(p), len(kept)])
    return {"tokens": tokens, "lengths": lengths, "label": torch.tensor(labels, dtype=torch.int8)}


def _recipe(policy, reference, loss_type: str, beta: float, desirable_weight=1.0, undesirable_weight=1.0,
            packing="padding_free") -> kto.KTO:
    """The recipe object around given models on one CPU process (what `KTO.__init__` sets, without assembling)."""
    recipe = kto.KTO.__new__(kto.KTO)
    ctx = SimpleNamespace(device=torch.device("cpu"), dims=SimpleNamespace(tp=1), autocast=contextlib.nullcontext(),
                          loss_context=contextlib.nullcontext)
    Recipe.__init__(recipe, SimpleNamespace(train=SimpleNamespace(grad_accum_steps=1)), policy, ctx)
    recipe.reference, recipe.logps_fn, recipe.packing = reference, chunked.token_logps, packing
    recipe.settings = {"beta": beta, "loss_type": loss_type, "desirable_weight": desirable_weight,
                       "undesirable_weight": undesirable_weight}
    return recipe


def _tiny(seed: int):
    from trainer.models.llama import Transformer

    torch.manual_seed(seed)
    model = Transformer(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=90, max_seq_len=64,
                        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    model.init_buffers()
    return model


def _case(gen, rows: int, width: int):
    prompts = [torch.randint(0, PAD, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, width - 1, (rows,), generator=gen)]
    completions = [torch.randint(0, PAD, (int(n),), generator=gen).tolist()
                   for n in torch.randint(1, width + 4, (rows,), generator=gen)]
    labels = (torch.rand(rows, generator=gen) < 0.5).long().tolist()
    return prompts, completions, labels


def parity(loss_type: str, seed: int, rows: int = 5, width: int = 12, **weights) -> tuple[float, float, dict, dict]:
    """(|loss - TRL's|, max |gradient - TRL's| over the parameters, our metrics, TRL's) of a tiny model against a
    perturbed copy as the reference, in float32, on one micro-batch of `rows` unpaired rows cut to `width` tokens
    (long completions cut, and cut again behind another prompt in the KL pairs)."""
    model, reference = _tiny(seed), _tiny(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    reference.requires_grad_(False)
    prompts, completions, labels = _case(gen, rows, width)
    recipe = _recipe(model, reference, loss_type, 0.3, **weights)
    (micro,) = recipe.micro_batches(stored_rows(prompts, completions, labels, width), 1)
    loss = recipe.loss(micro)
    ours = recipe.record(1)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    def logps_of(m):
        return _fused(lambda ids, labels_: m(ids[:, :-1], labels_[:, 1:], loss_fn=chunked.token_logps))

    batch = trl_batch(prompts, completions, labels, width, kl=loss_type == "kto")
    theirs, metrics = trl_kto(batch, logps_of(model), logps_of(reference), loss_type=loss_type, beta=0.3, **weights)
    their_grads = torch.autograd.grad(theirs, list(model.parameters()))
    return (float((loss - theirs).abs()), max(float((g - t).abs().max()) for g, t in zip(grads, their_grads,
                                                                                         strict=True)), ours, metrics)


@pytest.mark.parametrize("loss_type", kto.LOSS_TYPES)
def test_each_loss_type_trains_a_tiny_model_as_trl_does(loss_type):
    """Each of TRL 1.16's KTO loss types, the weights off their defaults: the same loss, gradients and metrics as
    TRL's `_compute_loss` on its own collator's batch (the KL pairs its rotation) to 1e-5 in float32."""
    for seed in range(3):
        loss_diff, grad_diff, ours, metrics = parity(loss_type, seed, desirable_weight=1.3, undesirable_weight=0.7)
        assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (seed, loss_diff, grad_diff)
        assert set(ours) == set(metrics) & set(kto.METRICS), (set(ours), set(metrics))
        for key in ours:
            assert ours[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-5), key
    assert metrics["kl"] > 0 if loss_type == "kto" else metrics["kl"] == 0


@settings(max_examples=examples(25))
@given(rows=st.integers(1, 6), beta=st.floats(0.01, 2.0), loss_type=st.sampled_from(kto.LOSS_TYPES),
       desirable=st.floats(0.0, 2.0), undesirable=st.floats(0.0, 2.0), kl=st.floats(0.0, 3.0),
       seed=st.integers(0, 2**16))
def test_the_loss_and_its_gradient_are_trls_in_float64(rows, beta, loss_type, desirable, undesirable, kl, seed):
    """`kto_loss` on drawn summed log-probabilities and labels (all of one kind too) against TRL's `_compute_loss`
    on per-token log-probabilities that sum to them, with the KL pairs' giving the drawn estimate."""
    gen = torch.Generator().manual_seed(seed)
    tokens = 4
    policy = (-torch.rand(rows, tokens, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    ref = -torch.rand(rows, tokens, generator=gen, dtype=torch.float64) * 3
    labels = (torch.rand(rows, generator=gen) < 0.5).long()
    kl_policy = torch.zeros(rows, tokens, dtype=torch.float64)
    kl_policy[:, 0] = kl  # the mismatched pairs' difference, on average the drawn estimate
    weights = {"desirable_weight": desirable, "undesirable_weight": undesirable}
    estimate = kto.kl_estimate(kl_policy.sum(-1), torch.zeros(rows, dtype=torch.float64))
    loss, _ = kto.kto_loss(policy.sum(-1), ref.sum(-1), labels, estimate, beta, loss_type, **weights)
    ids = torch.zeros(rows, tokens + 1, dtype=torch.long)
    kl_ids = torch.zeros(rows, tokens + 1, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": torch.ones_like(ids),
             "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(ids),
             "KL_completion_mask": torch.ones_like(ids), "label": labels.bool()}
    theirs, metrics = trl_kto(batch, _fused(lambda i, _: policy if i is ids else kl_policy),
                              _fused(lambda i, _: ref if i is ids else torch.zeros_like(kl_policy)),
                              loss_type=loss_type, beta=beta, **weights)
    torch.testing.assert_close(loss, theirs.to(loss.dtype), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, policy)[0], torch.autograd.grad(theirs, policy)[0],
                               rtol=1e-9, atol=1e-12)
    assert metrics["kl"] == pytest.approx(kl if loss_type == "kto" else 0)


def test_the_defaults_and_loss_types_are_trls():
    """conf/recipe/kto.yaml over the schema against TRL 1.16's KTOConfig: every key they share has its default,
    and recipe.loss_type takes KTOConfig's choices."""
    import trl

    from trainer.config.compose import compose

    ours = compose(["recipe=kto", "data=preference"]).recipe
    theirs = {f.name: f.default for f in dataclasses.fields(trl.KTOConfig)}
    shared = ("beta", "loss_type", "desirable_weight", "undesirable_weight")
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    (loss_type,) = [f for f in dataclasses.fields(trl.KTOConfig) if f.name == "loss_type"]
    assert tuple(loss_type.metadata["choices"]) == kto.LOSS_TYPES


GOOD, BAD = "I am fine, thank you.", "def main(): return 42"


def unpaired_rows(n: int, seed: int) -> list[dict]:
    """`n` conversational unpaired rows, about 70% desirable (a polite answer), the rest a code snippet."""
    rng = random.Random(seed)
    labels = [rng.random() < 0.7 for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": rng.choice(SAMPLE)[:30]}],
             "completion": [{"role": "assistant", "content": GOOD if label else BAD}], "label": label}
            for label in labels]


@pytest.fixture(scope="module")
def kto_setup(tmp_path_factory):
    """A tiny Llama with its tokenizer and chat template, and 48 unpaired rows in a JSONL file."""
    rows = unpaired_rows(48, 0)
    root = tmp_path_factory.mktemp("kto")
    (root / "unpaired.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return add_tokenizer(make_llama(str(root))), str(root / "unpaired.jsonl"), rows


ARGS = ["recipe=kto", "data=preference", "data.seq_len=40", "train.global_batch_size=4", "train.progress=false",
        "train.log_every=1", "lr_schedule=constant", "lr_schedule.warmup_steps=0", "optim.lr=1e-2",
        "optim.weight_decay=0", "optim.betas=[0.9,0.999]", "data.shuffle=false"]


def _trl_run(model_path: str, rows: list[dict], steps: int, out: str) -> list[dict]:
    """TRL 1.16's KTOTrainer on `rows` in their order: its log of each step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import KTOConfig

    torch.manual_seed(0)
    args = KTOConfig(output_dir=out, per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-2,
                     lr_scheduler_type="constant", logging_steps=1, bf16=False, report_to=[], use_cpu=True,
                     save_strategy="no", max_length=41, gradient_checkpointing=False, weight_decay=0.0,
                     disable_tqdm=True, optim="adamw_torch")
    trainer = KTOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path), args=args,
                         train_dataset=Dataset.from_list(rows),
                         processing_class=PreTrainedTokenizerFast.from_pretrained(model_path))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_the_first_losses_are_trl_ktotrainers(kto_setup, run_cli, tmp_path):
    """`python -m trainer recipe=kto` and TRL's KTOTrainer on the same model and unpaired rows, in the same order:
    the same losses (1e-4) at step 1 (the reference itself: 0.5), and after one to three AdamW updates, where the
    KL estimate and the rewards count; the same KL, rewards and gradient norms."""
    from trainer.data.chat import in_eval

    model, path, rows = kto_setup
    proc = run_cli("model=hf", f"model.path={model}", *ARGS, f"data.path={path}", "train.max_steps=4",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = read_metrics(str(tmp_path / "run"))
    train = [r for i, r in enumerate(rows) if not in_eval(f"unpaired.jsonl:{i}", SimpleNamespace(eval_percent=None))]
    theirs = _trl_run(model, train, 4, str(tmp_path / "trl"))
    assert ours[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    for mine, trl_line in zip(ours, theirs, strict=True):
        for key in ("loss", "kl", "grad_norm", *(k for k in kto.METRICS if k in trl_line)):
            assert mine[key] == pytest.approx(trl_line[key], rel=1e-4, abs=1e-5), (mine["step"], key)
    print("loss, ours - TRL's:", [m["loss"] - t["loss"] for m, t in zip(ours, theirs, strict=True)],
          "kl:", [(m["kl"], t["kl"]) for m, t in zip(ours, theirs, strict=True)])
    assert any(m["kl"] > 0 for m in ours)


@pytest.mark.e2e
def test_pairs_are_unpaired_as_trl_unpairs_them(kto_setup, run_cli, tmp_path):
    """Paired rows train under recipe=kto as TRL's unpair_preference_dataset makes them: the chosen answer
    desirable, the rejected not, two rows a pair; the reward margin grows."""
    model, _, _ = kto_setup
    rng = random.Random(1)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": rng.choice(SAMPLE)[:30], "chosen": GOOD, "rejected": BAD}) + "\n"
                            for _ in range(24)))
    proc = run_cli("model=hf", f"model.path={model}", *ARGS[:-1], f"data.path={path}", "train.max_steps=6",
                   "recipe.beta=0.5", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "corpus rows: {'train': 48, 'eval': 0}" in proc.stdout + proc.stderr
    metrics = read_metrics(str(tmp_path / "run"))
    assert metrics[-1]["rewards/margins"] > 0.1 and metrics[-1]["loss"] < 0.5


def test_kto_runs_that_cannot_train_are_refused(kto_setup, tmp_path, capsys):
    model, path, _ = kto_setup
    hf = ["model=hf", f"model.path={model}"]
    good = [*hf, *ARGS, f"data.path={path}"]
    assert "data='stdlib': recipe=kto trains on data=preference" in compose_refused(tmp_path, capsys, *hf,
                                                                                    "recipe=kto")
    refusals = {
        "recipe.loss_type=sigmoid": "recipe.loss_type='sigmoid': must be one of kto, apo_zero_unpaired",
        "recipe.beta=0": "recipe.beta=0.0: must be > 0",
        "recipe.desirable_weight=-1": "recipe.desirable_weight=-1.0: must be >= 0",
        "recipe.label_smoothing=0.1": "recipe.label_smoothing=0.1: recipe=kto reads no label_smoothing; recipe=dpo",
        "recipe.num_generations=4": "recipe.num_generations=4: recipe=kto reads no num_generations",
        "data.chat.mask=last": "data.chat.mask='last': recipe=kto counts each completion's tokens as TRL's",
        "train.global_batch_size=1": "train.global_batch_size=1: gives micro-batches of 1 row",
    }
    for override, message in refusals.items():
        err = compose_refused(tmp_path, capsys, *good, override)
        assert message in err and err.count("\n") == 1, (override, err)
    err = compose_refused(tmp_path, capsys, *good, "recipe.desirable_weight=0", "recipe.undesirable_weight=0")
    assert "recipe.desirable_weight=0.0: and recipe.undesirable_weight are both 0" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "completion": "yes", "label": "yes"}) + "\n")
    err = compose_refused(tmp_path, capsys, *good, f"data.path={bad}")
    assert f"row 1 of {bad} is not a form data=preference with recipe=kto reads" in err
    assert "give prompt, completion and label (unpaired preference, label a bool), or a pair" in err
    # Unpaired rows under recipe=dpo: refused, naming recipe=kto.
    err = compose_refused(tmp_path, capsys, *hf, *ARGS[2:], "recipe=dpo", "data=preference", f"data.path={path}")
    assert f"row 1 of {path} is an unpaired preference (prompt, completion, label), which only recipe=kto" in err


@pytest.mark.e2e
def test_two_ranks_under_ddp_and_fsdp2_and_lora(kto_setup, run_cli, tmp_path):
    """2 gloo ranks under torchrun: ddp and fsdp2 give the same losses, KL and rewards (each rank's micro-batch its
    own KL pairs, the estimate averaged over the ranks); LoRA trains too, its reference the adapters off."""
    model, path, _ = kto_setup
    args = ["model=hf", f"model.path={model}", *ARGS, f"data.path={path}", "train.max_steps=5", "recipe.beta=0.5",
            "data.shuffle=true", *DIST]
    runs = {}
    for name, extra in (("ddp", ["strategy=ddp"]), ("fsdp2", ["strategy=fsdp2"]),
                        ("lora", ["strategy=ddp", "peft=lora", "optim.lr=5e-2"])):
        proc = run_cli(*args, *extra, f"hydra.run.dir={tmp_path / name}")
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        runs[name] = read_metrics(str(tmp_path / name))
    for key in ("loss", "kl", "rewards/chosen", "rewards/margins", "grad_norm"):  # a step of one kind: no margin
        ddp = [m.get(key, math.nan) for m in runs["ddp"]]
        assert [m.get(key, math.nan) for m in runs["fsdp2"]] == pytest.approx(ddp, rel=1e-4, abs=1e-6, nan_ok=True), key
    for name in runs:
        assert runs[name][0]["loss"] == pytest.approx(0.5, abs=1e-6)
        assert runs[name][-1]["loss"] < 0.45 and any(m.get("rewards/margins", 0) > 0 for m in runs[name]), name
    assert math.isfinite(runs["lora"][-1]["kl"])
