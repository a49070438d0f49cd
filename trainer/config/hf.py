"""`model=hf`: a Hugging Face model directory's `config.json`, checked and read as the `model` section's
values (`fill_config`), so that the resolved config.yaml describes the model like any preset's. No torch:
the driver fills the section before it checks it."""

from __future__ import annotations

import glob
import json
import os

from trainer.errors import ConfigError

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# The same families with a sequence-classification head (`score`) instead of the LM head: reward models.
CLASSIFIERS = tuple(a.replace("ForCausalLM", "ForSequenceClassification") for a in ARCHITECTURES)


def is_classifier(hf: dict) -> bool:
    """Whether config.json `hf` (read by `read_config`) describes a *ForSequenceClassification model."""
    return hf["architectures"][0] in CLASSIFIERS


def num_labels(hf: dict) -> int:
    """The classifier's output width, as transformers' PretrainedConfig reads it (id2label, else num_labels)."""
    return len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))


def read_config(path: str | None, key: str = "model.path") -> dict:
    """The model directory's config.json, after checking that trainjob can run the model it describes."""
    if not path:
        raise ConfigError(
            key,
            path,
            "model=hf needs a Hugging Face model directory (config.json and "
            "model.safetensors or its shards): model.path=/models/<name>",
        )
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ConfigError(key, path, "must be a Hugging Face model directory holding config.json")
    with open(file) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES + CLASSIFIERS:
        raise ConfigError(
            key,
            path,
            f"its architecture {', '.join(archs) or '(none given)'} is not supported; "
            f"trainjob fine-tunes {', '.join(ARCHITECTURES)} (and their *ForSequenceClassification reward models)",
        )
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ConfigError(
            key,
            path,
            "holds no *.safetensors weights (save the model with save_pretrained(..., safe_serialization=True))",
        )
    unsupported = {"attention_bias": True, "mlp_bias": True, "use_sliding_window": True}
    for name, bad in unsupported.items():
        if hf.get(name) == bad:
            raise ConfigError(key, path, f"config.json sets {name}={bad}, which trainjob's model does not have")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(key, path, f"config.json sets hidden_act={hf['hidden_act']!r}; only silu is supported")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        raise ConfigError(
            key,
            path,
            f"config.json sets head_dim={hf['head_dim']}; trainjob's model needs hidden_size / num_attention_heads",
        )
    return hf


def rope(hf: dict, path: str) -> tuple[float, dict | None]:
    """(theta, llama3 scaling or None) from either the transformers 4 (`rope_theta`, `rope_scaling`) or the
    transformers 5 (`rope_parameters`) spelling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, {k: params[k] for k in keys}
    raise ConfigError("model.path", path, f"RoPE type {kind!r} is not supported; trainjob has default and llama3")


def settings(path: str) -> dict:
    """The `model.*` values (ModelConfig's fields) of the model in directory `path`."""
    hf = read_config(path)
    theta, _ = rope(hf, path)
    max_seq_len = int(hf.get("max_position_embeddings", 2048))
    if hf["architectures"][0].startswith("Mistral") and hf.get("sliding_window"):
        # Within the window, Mistral's sliding-window attention is full causal attention.
        max_seq_len = min(max_seq_len, int(hf["sliding_window"]))
    return {
        "dim": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "ffn_dim": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "max_seq_len": max_seq_len,
        "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def fill_config(model_cfg) -> None:
    """With `model=hf`, set the model.* keys from the directory's config.json (the resolved config.yaml then
    describes the model like any preset's)."""
    if model_cfg.name == "hf":
        for key, value in settings(model_cfg.path).items():
            model_cfg[key] = value
