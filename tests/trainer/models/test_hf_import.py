"""`model=hf`: a Hugging Face directory's weights give `transformers`' logits, and what cannot run is refused.

The models are tiny random ones built and saved with `transformers` (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.conftest import compose_run
from tests.trainer.hf_models import make_llama, make_mistral, make_qwen2
from trainer.config.hf import settings
from trainer.errors import ConfigError
from trainer.models import from_hf, hf

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    return {
        "llama": make_llama(root),
        "qwen2": make_qwen2(root),
        "llama-tied": make_llama(root, tie=True),
        "mistral": make_mistral(root),
    }


def _hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-tied", "mistral"])
def test_from_hf_gives_the_logits_of_transformers(hf_dirs, name):
    tokens = torch.randint(0, 320, (2, 80), generator=torch.Generator().manual_seed(0))
    model = from_hf(hf_dirs[name]).eval()
    with torch.no_grad():
        ours = model(tokens)
    assert ours.shape == (2, 80, 320)
    # 80 positions pass the scaled RoPE's original 64-token context, where llama3 scaling changes frequencies.
    torch.testing.assert_close(ours, _hf_logits(hf_dirs[name], tokens), rtol=0, atol=1e-5)


def test_qwen2_is_read_from_its_shards_with_biases_and_tied_embeddings(hf_dirs):
    path = hf_dirs["qwen2"]
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    model = from_hf(path)
    assert model.output is None and model.layers["0"].attention.wq.bias is not None
    assert model.layers["0"].attention.wo.bias is None


def test_llama3_rope_scaling_and_mistrals_window_are_read(hf_dirs):
    model = from_hf(hf_dirs["llama"])
    assert model.rope_scaling["factor"] == 8.0 and model.rope_theta == 500000.0
    assert settings(hf_dirs["mistral"])["max_seq_len"] == 128  # sequences beyond the window are refused


def _with_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_other_architectures_and_features_are_refused_by_name(hf_dirs, tmp_path):
    gpt2 = _with_config(hf_dirs["llama"], str(tmp_path / "gpt2"), architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="GPT2LMHeadModel is not supported; trainjob fine-tunes LlamaForCausalLM"):
        settings(gpt2)
    yarn = _with_config(hf_dirs["llama"], str(tmp_path / "yarn"), rope_parameters={"rope_type": "yarn"})
    with pytest.raises(ConfigError, match="RoPE type 'yarn' is not supported"):
        hf.build(yarn)
    with pytest.raises(ConfigError, match="model.path=None.*needs a Hugging Face model directory"):
        settings(None)
    with pytest.raises(ConfigError, match=r"holds no config.json \(.*\): give a Hugging Face model directory"):
        settings(str(tmp_path))


def test_weights_of_the_wrong_shape_are_refused(hf_dirs, tmp_path):
    wrong = _with_config(hf_dirs["llama"], str(tmp_path / "wide"), intermediate_size=256)
    with pytest.raises(ConfigError, match=r"its weights hold \(128, 64\) for model.layers.0.mlp.gate_proj.weight"):
        from_hf(wrong)


def test_model_hf_fills_the_model_keys_from_config_json(hf_dirs, tmp_path):
    run = compose_run(tmp_path, "model=hf", f"model.path={hf_dirs['llama']}", "train.max_steps=1")
    model = run.spec.config["model"]
    assert (model["dim"], model["n_layers"], model["n_heads"], model["n_kv_heads"], model["ffn_dim"]) == (
        64,
        2,
        4,
        2,
        128,
    )
    assert (model["vocab_size"], model["rope_theta"], model["max_seq_len"]) == (320, 500000.0, 256)


def test_model_hf_without_a_path_exits_2_naming_the_key(run_cli, tmp_path):
    proc = run_cli("model=hf", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert "model.path=None: model=hf needs a Hugging Face model directory" in proc.stderr
    assert not (tmp_path / "run").exists()
