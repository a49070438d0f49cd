"""Hugging Face model directories: checkpoint names mapped onto our `Transformer` by the model's family
(`trainer.config.families`), and the weights read from the safetensors files slice by slice (`config.json`, read as
our model's settings, is the config's: `trainer.config.hf`).

Loading goes through torch.distributed.checkpoint's `HuggingFaceStorageReader`: the state dict handed to
`dcp.load` holds each rank's own parameters (DTensor shards under FSDP2 or TP, whole tensors under DDP),
so each rank reads with `safe_open(...).get_slice` only the rows and columns it keeps, from a single
`model.safetensors` or from every shard of a sharded checkpoint, and converts them to its own dtype. A fused
checkpoint tensor (Phi-3's `qkv_proj`, `gate_up_proj`) holds several of our parameters stacked by rows: each
rank reads each piece's rows (`get_slice`) and keeps its own part of them.

Hugging Face's layouts use the "rotate half" RoPE convention our model uses, so every tensor maps by name
alone, with no permutation.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.config import families
from trainer.config.hf import read_config, rope, settings
from trainer.errors import ConfigError
from trainer.models.llama import Transformer

# What activation-checkpoint wrappers insert into parameter names.
WRAPPED = "_checkpoint_wrapped_module."


def family_of(model: nn.Module) -> families.Family:
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    return families.BY_NAME[inner.family]


def hf_name(name: str, family: families.Family | None = None, head: str = "lm_head") -> str:
    """The checkpoint's name for our parameter `name` (such as `layers.0.attention.wq.weight`) in `family`'s
    layout (Llama's by default); a piece of a fused tensor gives the fused tensor's name. Our `output` is `head`
    (`lm_head`, or a classifier's `score`: `trainer.models.score`)."""
    if name.startswith("output."):
        return f"{head}.{name.removeprefix('output.')}"
    return families.hf_name(family or families.BY_NAME["llama"], name)


def _inner(name: str) -> str:
    """`layers.3.attention.wq.weight` -> `attention.wq`."""
    return name.split(".", 2)[2].rsplit(".", 1)[0] if name.startswith("layers.") else ""


def hf_state(params: dict[str, torch.Tensor], family: families.Family, head: str = "lm_head"
             ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (Hugging Face names, fused tensors joined) of our full parameters `params`; our
    `output` named `head` (see `hf_name`)."""
    out, pieces = {}, {}
    for name, p in params.items():
        theirs = hf_name(name, family, head)
        if _inner(name) not in _fused_names(family):
            out[theirs] = p
        else:
            pieces.setdefault(theirs, {})[_inner(name)] = p
    for theirs, parts in pieces.items():
        order = next(ours for ours in family.fused.values() if set(parts) <= set(ours))
        out[theirs] = torch.cat([parts[piece] for piece in order], dim=0)
    return out


def _fused_names(family: families.Family) -> set[str]:
    return {piece for ours in family.fused.values() for piece in ours}


def build(path: str) -> Transformer:
    """The model of directory `path`, its weights not loaded (build it on the meta device)."""
    hf = read_config(path)
    _, scaling = rope(hf, path)
    return Transformer(**settings(path), rope_scaling=scaling)


def _weight_files(path: str) -> dict[str, str]:
    """Checkpoint tensor name -> the safetensors file in `path` holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    from safetensors import safe_open

    files = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                files.update({k: os.path.join(path, name) for k in f.keys()})  # noqa: SIM118
    return files


def _load_fused(params: dict[str, torch.Tensor], family: families.Family, path: str, saved: dict) -> None:
    """Fill our parameters that are pieces of fused checkpoint tensors: each piece's rows are read, and each
    rank keeps its own part of them."""
    from safetensors import safe_open

    files = _weight_files(path)
    for name, param in params.items():
        theirs, inner = hf_name(name, family), _inner(name)
        block, leaf = ".".join(name.split(".")[:2]), name.rsplit(".", 1)[1]  # layers.<i>, weight
        ours = next(o for o in family.fused.values() if inner in o)
        sizes = {p: params[f"{block}.{p}.{leaf}"].shape[0] for p in ours}
        start, rows = families.fused_rows(family, inner, sizes)
        stored = tuple(saved[theirs].size) if theirs in saved else None
        expected = (sum(sizes.values()), *param.shape[1:])
        if stored != expected:
            _refuse(path, stored or "nothing", theirs, expected)
        with safe_open(files[theirs], "pt") as f:
            full = f.get_slice(theirs)[start : start + rows].to(param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)


def _refuse(path: str, found, name: str, shape) -> None:
    raise ConfigError("model.path", path, f"its weights hold {found} for {name}, the model its config.json "
                      f"describes needs shape {tuple(shape)}")


def load_weights(model: nn.Module, path: str) -> list[str]:
    """Fill `model`'s parameters (sharded or not, on any device) from the safetensors files in `path`; every
    rank calls this, and reads only its own slices. Returns the names of those left as they were: a score head
    (`trainer.models.score`) that a causal LM's directory does not hold, a value head."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    family = family_of(inner)
    # LoRA adapters (`.lora_A.`, `.lora_B.`) are not in a pretrained directory; trainer.models.lora starts them.
    head = "score" if getattr(inner, "score_head", False) else "lm_head"
    ours = {name.replace(WRAPPED, ""): p for name, p in inner.named_parameters() if ".lora_" not in name}
    # recipe=ppo's value head (`trainer.models.score.attach_value_head`): no directory holds it, it starts fresh.
    fresh = [name for name in ours if name.startswith("value_head.")]
    for name in fresh:
        del ours[name]
    fused = {n: p for n, p in ours.items() if _inner(n) in _fused_names(family)}
    state = {hf_name(name, family, head): param for name, param in ours.items() if name not in fused}
    reader = HuggingFaceStorageReader(path)
    saved = reader.read_metadata().state_dict_metadata
    untouched = []
    if head == "score" and "score.weight" not in saved:
        del state["score.weight"]
        untouched.append("output.weight")
    for name, param in state.items():
        if name not in saved or tuple(saved[name].size) != tuple(param.shape):
            _refuse(path, tuple(saved[name].size) if name in saved else "nothing", name, param.shape)
    with torch.no_grad():
        dcp.load(state, storage_reader=reader)
        if fused:
            _load_fused(fused, family, path, saved)
    inner.init_buffers()
    return untouched + fresh


def on_cpu(model: nn.Module, path: str, load) -> nn.Module:
    """`model` (built on the meta device) made in fp32 on the CPU and filled by `load(model, path)`: a directory's
    pretrained model in one process, whichever code (ours, or transformers') runs it."""
    model.to_empty(device="cpu")
    with warnings.catch_warnings():  # DCP says it assumes a single process: it is one here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        load(model, path)
    return model


def from_hf(path: str) -> Transformer:
    """The pretrained model in Hugging Face directory `path`, in fp32 on the CPU; its forward gives logits
    of shape (batch, seq, vocab)."""
    with torch.device("meta"):
        model = build(path)
    return on_cpu(model, path, load_weights)
