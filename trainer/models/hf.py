"""Hugging Face model directories: checkpoint names mapped onto our `Transformer`, and the weights read from
the safetensors files slice by slice (`config.json`, read as our model's settings, is the config's:
`trainer.config.hf`).

Loading goes through torch.distributed.checkpoint's `HuggingFaceStorageReader`: the state dict handed to
`dcp.load` holds each rank's own parameters (DTensor shards under FSDP2 or TP, whole tensors under DDP),
so each rank reads with `safe_open(...).get_slice` only the rows and columns it keeps, from a single
`model.safetensors` or from every shard of a sharded checkpoint, and converts them to its own dtype.

Hugging Face's Llama-family layout already uses the "rotate half" RoPE convention our model uses, so
every tensor maps by name alone, with no permutation.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from trainer.config.hf import read_config, rope, settings
from trainer.errors import ConfigError
from trainer.models.llama import Transformer

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
# What activation-checkpoint wrappers insert into parameter names.
WRAPPED = "_checkpoint_wrapped_module."


def hf_name(name: str, head: str = "lm_head") -> str:
    """Hugging Face's name for our parameter `name` (such as `layers.0.attention.wq.weight`); our `output` is
    `head` (`lm_head`, or a classifier's `score`: `trainer.models.score`)."""
    module, leaf = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, index, inner = module.split(".", 2)
        return f"model.layers.{index}.{_BLOCK[inner]}.{leaf}"
    return f"{head if module == 'output' else _TOP[module]}.{leaf}"


def build(path: str) -> Transformer:
    """The model of directory `path`, its weights not loaded (build it on the meta device)."""
    hf = read_config(path)
    _, scaling = rope(hf, path)
    return Transformer(**settings(path), qkv_bias=hf["architectures"][0].startswith("Qwen2"), rope_scaling=scaling)


def load_weights(model: nn.Module, path: str) -> list[str]:
    """Fill `model`'s parameters (sharded or not, on any device) from the safetensors files in `path`; every
    rank calls this, and reads only its own slices. Returns the names of those left as they were: a score head
    (`trainer.models.score`) that a causal LM's directory does not hold."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    # LoRA adapters (`.lora_A.`, `.lora_B.`) are not in a pretrained directory; trainer.models.lora starts them.
    head = "score" if getattr(inner, "score_head", False) else "lm_head"
    state = {
        hf_name(name.replace(WRAPPED, ""), head): param
        for name, param in inner.named_parameters() if ".lora_" not in name
    }
    reader = HuggingFaceStorageReader(path)
    saved = reader.read_metadata().state_dict_metadata
    untouched = []
    if head == "score" and "score.weight" not in saved:
        del state["score.weight"]
        untouched.append("output.weight")
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
    return untouched


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
