"""Model construction: build a model from `cfg.model` on the meta device, and initialise it in place.

Initialisation is sharding-invariant: every parameter is drawn whole from a generator seeded by the run
seed and the parameter's name, then loaded through `set_model_state_dict`, which slices it for DDP,
FSDP2, TP or any composition. So every strategy and world size starts from the same weights.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from trainer.models.llama import Transformer


def build(cfg) -> Transformer:
    """The model described by `cfg` (a `ModelConfig`), on the current default device."""
    return Transformer(
        dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len,
        rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings,
    )


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


def init_weights(model: nn.Module, shapes: dict, seed: int, std: float, n_layers: int) -> None:
    """Initialise every parameter of `model` (sharded or not) and its rotary tables, in place."""
    groups: dict[str, list[str]] = {}
    for name in shapes:
        groups.setdefault(".".join(name.split(".")[:2]) if name.startswith("layers.") else name, []).append(name)
    options = StateDictOptions(full_state_dict=True, strict=False)
    # One block at a time, so that a large model never holds two full copies.
    for names in groups.values():
        part = {n: _draw(n, *shapes[n], seed=seed, std=std, n_layers=n_layers) for n in names}
        set_model_state_dict(model, part, options=options)
    inner = model.module if hasattr(model, "module") else model
    inner.init_buffers()


def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameter count of the full (unsharded) model."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or (exclude_embeddings and "tok_embeddings" in name):
            continue
        seen.add(id(p))
        total += p.numel()
    return total
