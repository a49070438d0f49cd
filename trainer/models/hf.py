"""Hugging Face model directories: `config.json` read as our model's settings, checkpoint names mapped
onto our `Transformer`, and the weights read from the safetensors files slice by slice.

Loading goes through torch.distributed.checkpoint's `HuggingFaceStorageReader`: the state dict handed to
`dcp.load` holds each rank's own parameters (DTensor shards under FSDP2 or TP, whole tensors under DDP),
so each rank reads with `safe_open(...).get_slice` only the rows and columns it keeps, from a single
`model.safetensors` or from every shard of a sharded checkpoint, and converts them to its own dtype.

Hugging Face's Llama-family layout already uses the "rotate half" RoPE convention our model uses, so
every tensor maps by name alone, with no permutation.
"""

from __future__ import annotations

import glob
import json
import os
import warnings

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.models.llama import Transformer

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# Our name inside a block -> Hugging Face's, under `model.layers.<i>.`.
_BLOCK = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str:
    """Hugging Face's name for our parameter `name` (such as `layers.0.attention.wq.weight`)."""
    module, leaf = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, index, inner = module.split(".", 2)
        return f"model.layers.{index}.{_BLOCK[inner]}.{leaf}"
    return f"{_TOP[module]}.{leaf}"


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
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConfigError(
            key,
            path,
            f"its architecture {', '.join(archs) or '(none given)'} is not supported; "
            f"trainjob fine-tunes {', '.join(ARCHITECTURES)}",
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


def _rope(hf: dict, path: str) -> tuple[float, dict | None]:
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
    theta, _ = _rope(hf, path)
    max_seq_len = int(hf.get("max_position_embeddings", 2048))
    if hf["architectures"][0] == "MistralForCausalLM" and hf.get("sliding_window"):
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


def build(path: str) -> Transformer:
    """The model of directory `path`, its weights not loaded (build it on the meta device)."""
    hf = read_config(path)
    _, scaling = _rope(hf, path)
    return Transformer(**settings(path), qkv_bias=hf["architectures"][0] == "Qwen2ForCausalLM", rope_scaling=scaling)


def load_weights(model: nn.Module, path: str) -> None:
    """Fill `model`'s parameters (sharded or not, on any device) from the safetensors files in `path`; every
    rank calls this, and reads only its own slices."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from trainer.models import WRAPPED

    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    # LoRA adapters (`.lora_A.`, `.lora_B.`) are not in a pretrained directory; trainer.models.lora starts them.
    state = {
        hf_name(name.replace(WRAPPED, "")): param for name, param in inner.named_parameters() if ".lora_" not in name
    }
    reader = HuggingFaceStorageReader(path)
    saved = reader.read_metadata().state_dict_metadata
    for name, param in state.items():
        if name not in saved or tuple(saved[name].size) != tuple(param.shape):
            found = tuple(saved[name].size) if name in saved else "nothing"
            raise ConfigError(
                "model.path",
                path,
                f"its weights hold {found} for {name}, the model its config.json "
                f"describes needs shape {tuple(param.shape)}",
            )
    with torch.no_grad():
        dcp.load(state, storage_reader=reader)
    inner.init_buffers()


def from_hf(path: str) -> Transformer:
    """The pretrained model in Hugging Face directory `path`, in fp32 on the CPU; its forward gives logits
    of shape (batch, seq, vocab)."""
    with torch.device("meta"):
        model = build(path)
    model.to_empty(device="cpu")
    with warnings.catch_warnings():  # DCP says it assumes a single process: it is one here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        load_weights(model, path)
    return model
