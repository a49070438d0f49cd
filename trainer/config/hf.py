"""`model=hf` on trainjob's own decoder (`model.impl=native`): a Hugging Face model directory's `config.json`,
checked and read as the `model` section's values (`trainer.config.hf_impl.fill_config` chooses the impl and fills
the section), so that the resolved config.yaml describes the model like any preset's. No torch: the driver fills
the section before it checks it.

Every native family (`trainer.config.families`) is read by one function, from the keys transformers 4 and 5 write
(`rope_parameters` or `rope_theta`/`rope_scaling`/`rope_local_base_freq`; `layer_types` or
`sliding_window_pattern`; `num_experts` or `num_local_experts`); what a family's config.json leaves out takes
transformers' default for that family."""

from __future__ import annotations

import glob
import json
import math
import os
import sys

from trainer.config.families import FAMILIES, Family
from trainer.config.runtime import config_errors
from trainer.errors import ConfigError
from trainjob.storage import fetch
from trainjob.storage.urls import is_url

ARCHITECTURES = tuple(FAMILIES)
# Families whose sliding_window, when set, applies to every layer (transformers has no layer_types for them).
WINDOW_EVERYWHERE = ("Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}


def safetensors_damage(file: str) -> str | None:
    """Why the safetensors file `file` cannot be loaded whole, or None: its header (an 8-byte length, then
    JSON) does not read, or the file is shorter than the tensors the header places in it (cut short by a
    copy or a full disk). Reads the header only."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > size - 8:
                return f"its header says {length} bytes, more than the file's {size}"
            header = json.loads(f.read(length))
        ends = [int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        return f"its header does not read ({type(e).__name__}: {e})"
    if 8 + length + max(ends, default=0) > size:
        return f"it is truncated ({size} of {8 + length + max(ends, default=0)} bytes)"
    return None
# The same families with a sequence-classification head (`score`) instead of the LM head: reward models.
CLASSIFIERS = tuple(a.replace("ForCausalLM", "ForSequenceClassification") for a in ARCHITECTURES)


def is_classifier(hf: dict) -> bool:
    """Whether config.json `hf` (read by `read_config`) describes a *ForSequenceClassification model."""
    return hf["architectures"][0] in CLASSIFIERS


def num_labels(hf: dict) -> int:
    """The classifier's output width, as transformers' PretrainedConfig reads it (id2label, else num_labels)."""
    return len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))


def causal_architecture(hf: dict) -> str:
    """config.json's architecture as its causal LM's name (a reward model's classifier is its family's)."""
    return hf["architectures"][0].replace("ForSequenceClassification", "ForCausalLM")


MODEL_DIRECTORY = "a Hugging Face model directory (config.json and model.safetensors or its shards)"


def merge_command(adapters: str, base: str) -> str:
    """The command that folds the PEFT adapters of directory `adapters` into their base `base` (PEFT's
    merge_and_unload, the base's tokenizer beside it) and writes the whole model to `<adapters>-merged`."""
    out = adapters.rstrip("/") + "-merged"
    return ("python -c \"from peft import AutoPeftModelForCausalLM as M; from transformers import AutoTokenizer as T; "
            f"M.from_pretrained('{adapters}').merge_and_unload().save_pretrained('{out}'); "
            f"T.from_pretrained('{base}').save_pretrained('{out}')\"")


def not_a_model_directory(path: str) -> str:
    """Why `path`, which holds no config.json, is not a model directory, and what to give instead: a PEFT adapter
    directory's merge command, a GGUF file's origin, or what a model directory holds."""
    gguf = path.endswith(".gguf") or (os.path.isdir(path) and bool(glob.glob(os.path.join(path, "*.gguf"))))
    if gguf:
        return (f"is a GGUF file (llama.cpp's format), which trainjob does not load: give {MODEL_DIRECTORY}, such "
                "as the one it was converted from")
    adapter = os.path.join(path, "adapter_config.json")
    if os.path.isfile(adapter):
        try:
            with open(adapter, encoding="utf-8") as f:
                base = json.load(f).get("base_model_name_or_path") or "<the base model directory>"
        except (OSError, ValueError, AttributeError):
            base = "<the base model directory>"
        out = path.rstrip("/") + "-merged"
        return (f"holds PEFT adapters (adapter_config.json), not a whole model: merge them into their base {base} "
                f"with `{merge_command(path, base)}`, then give model.path={out} (with peft=lora to train new "
                "adapters on it)")
    if not os.path.exists(path):
        return f"no such directory: give {MODEL_DIRECTORY}"
    if not os.path.isdir(path):
        return f"is a file, not a directory: give {MODEL_DIRECTORY}"
    found = sorted(os.listdir(path))[:5]
    return f"holds no config.json ({', '.join(found) or 'empty'}): give {MODEL_DIRECTORY}"


def local_model(path: str | None, key: str = "model.path", cache_dir: str | None = None) -> str | None:
    """`path` itself, or where it is a URL (hf://, s3://, gs://) the local copy of the model it names, fetched
    with Kubeflow's model file patterns into the storage cache (`trainjob.storage.fetch`; `cache_dir`: the run's
    data.cache_dir) unless the same versions are there; says which on stderr. A store's refusal: ConfigError."""
    if not path or not is_url(path):
        return path
    with config_errors():
        got = fetch.fetch(key, path, fetch.root(cache_dir), fetch.MODEL_PATTERNS)
    print(f"{key}={path}: {'fetched into' if got.copied else 'the copy in'} {got.local}", file=sys.stderr)
    return got.local


def read_json(path: str | None, key: str = "model.path") -> dict:
    """The config.json of model directory `path`, whatever its architecture; refused in one line where there is
    no such directory or its config.json does not read."""
    if not path:
        raise ConfigError(
            key,
            path,
            "model=hf needs a Hugging Face model directory (config.json and "
            "model.safetensors or its shards): model.path=/models/<name>",
        )
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ConfigError(key, path, not_a_model_directory(path))
    try:
        with open(file, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:  # cut short, not JSON, not UTF-8
        raise ConfigError(key, path, f"its {file} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(key, path, f"its {file} holds a JSON {type(hf).__name__}, not a model's config")
    return hf


def check_weights(path: str, key: str = "model.path") -> None:
    """Refuse, in one line naming the file, a directory without safetensors weights or with one that is damaged."""
    weights = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not weights:
        raise ConfigError(
            key,
            path,
            "holds no *.safetensors weights (save the model with save_pretrained(..., safe_serialization=True))",
        )
    for weights_file in weights:
        problem = safetensors_damage(weights_file)
        if problem:
            raise ConfigError(key, path, f"its weights {weights_file} cannot be loaded: {problem}")


def read_config(path: str | None, key: str = "model.path") -> dict:
    """The model directory's config.json, after checking that trainjob can run the model it describes."""
    hf = read_json(path, key)
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES + CLASSIFIERS:
        raise ConfigError(
            key,
            path,
            f"its architecture {', '.join(archs) or '(none given)'} is not supported; "
            f"trainjob fine-tunes {', '.join(ARCHITECTURES)} (and their *ForSequenceClassification reward models)",
        )
    check_weights(path, key)
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(key, path, f"config.json sets the activation {act!r}; trainjob has "
                          f"{', '.join(ACTIVATIONS)}")
    if float(_rope_params(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConfigError(key, path, "config.json sets partial_rotary_factor below 1; trainjob rotates whole heads")
    return hf


def family(hf: dict) -> Family:
    return FAMILIES[causal_architecture(hf)]


def _rope_params(hf: dict, layer_type: str = "full_attention") -> dict:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if layer_type in params or "full_attention" in params:  # Gemma 3 (transformers 5): one set per layer type
        params = params.get(layer_type) or {}
    return params


def rope(hf: dict, path: str) -> tuple[float, dict | None]:
    """(theta, scaling or None) of the global layers, from either the transformers 4 (`rope_theta`,
    `rope_scaling`) or the transformers 5 (`rope_parameters`) spelling. Scaling: llama3 or linear."""
    params = _rope_params(hf)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 1_000_000.0 if _gemma3(hf) else 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, {"rope_type": "llama3", **{k: params[k] for k in keys}}
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}
    raise ConfigError("model.path", path, f"RoPE type {kind!r} is not supported; trainjob has default, llama3 "
                      "and linear")


def _gemma3(hf: dict) -> bool:
    return causal_architecture(hf) == "Gemma3ForCausalLM"


def _layer_types(hf: dict, n_layers: int) -> list[str] | None:
    """Which layers attend within a sliding window (transformers' `layer_types`), or None: every layer is full."""
    window, arch = hf.get("sliding_window"), causal_architecture(hf)
    if not window or arch in ("MistralForCausalLM",) or hf.get("use_sliding_window") is False:
        return None
    types = hf.get("layer_types")
    if not types and arch.startswith("Gemma"):
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or
                      (6 if _gemma3(hf) else 2))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if not types and arch in WINDOW_EVERYWHERE:
        types = ["sliding_attention"] * n_layers
    if not types and hf.get("use_sliding_window"):  # Qwen2/3 before layer_types: the layers from max_window_layers
        first = int(hf.get("max_window_layers", n_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return list(types) if types and "sliding_attention" in types else None


def _moe(hf: dict, fam: Family, n_layers: int) -> dict:
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if not fam.moe or not experts:
        return {}
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = sorted({*(hf.get("mlp_only_layers") or []), *(i for i in range(n_layers) if (i + 1) % step)})
    return {
        "n_experts": experts,
        "n_experts_per_token": int(hf["num_experts_per_tok"]),
        "moe_ffn_dim": int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        "dense_layers": dense,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)) if fam.name != "mixtral" else True,
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        "output_router_logits": bool(hf.get("output_router_logits", False)),
    }


def _multipliers(hf: dict, fam: Family, head_dim: int) -> dict:
    scalar = hf.get("query_pre_attn_scalar")
    scale = hf.get("attention_multiplier") or (float(scalar) ** -0.5 if scalar else None)
    embedding = math.sqrt(hf["hidden_size"]) if fam.embedding_scale else float(hf.get("embedding_multiplier", 1.0))
    return {
        "embedding_multiplier": embedding,
        "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
        "attention_scale": float(scale) if scale and float(scale) != head_dim**-0.5 else None,
        "logits_scaling": float(hf.get("logits_scaling", 1.0)),
        "attn_softcap": _float_or_none(hf.get("attn_logit_softcapping")),
        "final_softcap": _float_or_none(hf.get("final_logit_softcapping")),
    }


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def _attention(hf: dict, fam: Family, n_layers: int) -> dict:
    types = _layer_types(hf, n_layers)
    local = None
    if _gemma3(hf):
        local_params = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
        local = float(local_params.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    nope = [i for i, rope in enumerate(hf.get("no_rope_layers") or []) if not rope]  # SmolLM3: 1 = RoPE
    bias = "qkv" if fam.qkv_bias else ("all" if hf.get("attention_bias") else "none")
    return {
        "attention_bias": bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "sliding_window": int(hf["sliding_window"]) if types else None,
        "layer_types": types,
        "rope_local_theta": local,
        "nope_layers": nope,
    }


def settings(path: str) -> dict:
    """The `model.*` values (ModelConfig's fields) of the model in directory `path`."""
    hf = read_config(path)
    fam = family(hf)
    theta, _ = rope(hf, path)
    max_seq_len = int(hf.get("max_position_embeddings", 2048))
    if fam.name == "mistral" and hf.get("sliding_window"):
        # Within the window, Mistral's sliding-window attention is full causal attention.
        max_seq_len = min(max_seq_len, int(hf["sliding_window"]))
    n_heads, n_layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // n_heads)
    return {
        "dim": hf["hidden_size"],
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "ffn_dim": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "max_seq_len": max_seq_len,
        "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", fam.tie_default)),
        "family": fam.name,
        "head_dim": head_dim if head_dim * n_heads != hf["hidden_size"] else None,
        "qk_norm": fam.qk_norm,
        "norm_placement": fam.norm_placement,
        "norm_offset": fam.norm_offset,
        "activation": ACTIVATIONS[hf.get("hidden_activation") or hf.get("hidden_act", "silu")],
        **_attention(hf, fam, n_layers),
        **_multipliers(hf, fam, head_dim),
        **_moe(hf, fam, n_layers),
    }

