"""Model construction: build a model from `cfg.model` on the meta device, and initialise it in place.

Initialisation is sharding-invariant: every parameter is drawn whole from a generator seeded by the run
seed and the parameter's name, and each rank keeps the slice its DTensor placement says (DDP, FSDP2, TP
or any composition). So every strategy and world size starts from the same weights.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.models import hf, hf_transformers
from trainer.models.hf import WRAPPED, from_hf
from trainer.models.llama import OPTION_KEYS, Transformer

__all__ = ["Transformer", "build", "count_params", "from_hf", "init_weights", "num_params",
           "param_shapes"]


def build(cfg) -> nn.Module:
    """The model described by `cfg` (a `ModelConfig`), on the current default device: our `Transformer`, or
    with `model.impl=transformers` transformers' own model behind its interface."""
    if getattr(cfg, "name", None) == "hf":  # a ModelConfig, or any config with the Transformer's keys
        if getattr(cfg, "impl", None) == "transformers":
            return hf_transformers.build(cfg.path)
        return hf.build(cfg.path)
    return Transformer(
        dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len,
        rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings,
        **_options(cfg),
    )


def _options(cfg) -> dict:
    """The family options `cfg` gives (a config without them is a Llama-style model)."""
    found = {}
    for key in OPTION_KEYS:
        value = getattr(cfg, key, None)
        if value is not None:
            found[key] = list(value) if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig" \
                else value
    return found


def param_shapes(model: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Full shapes of the parameters by name; read these on the meta model, before it is sharded."""
    return {name: (p.shape, p.dtype) for name, p in model.named_parameters()}


def _draw(name: str, shape: torch.Size, dtype: torch.dtype, seed: int, std: float, n_layers: int):
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    # Projections that write into the residual stream are scaled down with depth (GPT-2, Llama).
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        std = std / math.sqrt(2 * n_layers)
    return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=gen)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any wrapper a strategy added (DDP wraps; FSDP2 and TP work in place)."""
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def init_weights(model: nn.Module, shapes: dict, seed: int, std: float, n_layers: int,
                 only: list[str] | None = None) -> None:
    """Initialise every parameter of `model` (sharded or not), or the ones named in `only`, and its rotary
    tables, in place."""
    inner = unwrap(model)
    with torch.no_grad():
        for name, param in inner.named_parameters():
            clean = name.replace(WRAPPED, "")
            if only is not None and clean not in only:
                continue
            shape, dtype = shapes[clean]
            full = _draw(clean, shape, dtype, seed, std, n_layers).to(param.device)
            if isinstance(param, DTensor):
                # Every rank drew the same full tensor, so each takes its own slice: no communication,
                # and any placement works (uneven and strided shards included).
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)
    inner.init_buffers()


def count_params(cfg) -> int:
    """Parameter count of the model `cfg` (a `ModelConfig`) describes, without building all of it: one
    block on the meta device stands for every block, so any depth costs the same."""
    with torch.device("meta"):
        if cfg.name == "hf":
            return num_params(build(cfg))
        one = build(dataclasses.replace(cfg, n_layers=1))
    per_block = sum(p.numel() for p in one.layers["0"].parameters())
    return num_params(one) + (cfg.n_layers - 1) * per_block


def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameter count of the full (unsharded) model."""
    seen, total = set(), 0
    embeddings = getattr(unwrap(model), "tok_embeddings", None)  # none on a later pipeline stage
    if exclude_embeddings and embeddings is not None:
        seen = {id(p) for p in embeddings.parameters()}
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    return total
