"""`python -m trainer.export`: a checkpoint becomes a Hugging Face directory that `transformers` loads with
our model's logits, tokenizer included; what cannot be exported is refused before anything is written."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import TINY, cli
from tests.trainer.hf_models import add_tokenizer, make_llama
from trainer import export
from trainer.models import from_hf

pytestmark = pytest.mark.timeout(300)
STEPS = [
    "train.max_steps=2",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "train.progress=false",
    "data.seq_len=32",
    "train.global_batch_size=8",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """A `model=hf` run of two steps from a tiny Llama with a tokenizer, and its checkpoint."""
    root = tmp_path_factory.mktemp("export")
    source = add_tokenizer(make_llama(str(root)))
    run_dir = root / "run"
    proc = cli(cache_dir, root, "model=hf", f"model.path={source}", *STEPS, f"hydra.run.dir={run_dir}", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return source, str(run_dir / "checkpoints" / "step-2")


def _logits(model, tokens):
    with torch.no_grad():
        out = model.eval()(tokens)
    return out.logits if hasattr(out, "logits") else out


TOKENS = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.e2e
def test_export_loads_in_transformers_with_the_trained_models_logits(trained, run_cli, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, checkpoint = trained
    out = tmp_path / "finetuned"
    proc = run_cli(checkpoint, str(out), module="trainer.export")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    ours = _logits(export.load_model(checkpoint, export.run_config(checkpoint)), TOKENS)
    theirs = _logits(AutoModelForCausalLM.from_pretrained(out), TOKENS)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    # Training moved the weights: the export is not the starting model.
    assert (ours - _logits(from_hf(source), TOKENS)).abs().max() > 1e-3
    # The round trip back into our model gives the same logits again.
    torch.testing.assert_close(_logits(from_hf(str(out)), TOKENS), ours, rtol=0, atol=1e-5)
    text = "how are you? I am fine."
    assert (
        AutoTokenizer.from_pretrained(out)(text)["input_ids"]
        == AutoTokenizer.from_pretrained(source)(text)["input_ids"]
    )


@pytest.mark.e2e
def test_a_preset_exports_as_llama(run_cli, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    proc = run_cli(*TINY, *STEPS, "train.max_steps=1", "train.checkpoint_every=1", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = str(run_dir / "checkpoints" / "step-1")
    out = str(tmp_path / "out")
    export.export(checkpoint, out)
    ours = _logits(export.load_model(checkpoint, export.run_config(checkpoint)), TOKENS % 259)
    torch.testing.assert_close(
        _logits(AutoModelForCausalLM.from_pretrained(out), TOKENS % 259), ours, rtol=0, atol=1e-5
    )


def test_an_existing_out_or_a_non_checkpoint_is_refused_with_exit_2(trained, run_cli, tmp_path, capsys):
    _, checkpoint = trained
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = run_cli(checkpoint, str(mine), module="trainer.export")
    assert proc.returncode == 2
    assert f"OUT='{mine}': already exists" in proc.stderr
    assert os.listdir(mine) == ["notes.txt"]
    assert export.main([str(tmp_path), str(tmp_path / "new")]) == 2
    assert "must be a checkpoint directory" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
