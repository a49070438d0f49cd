"""FSDP2: `fully_shard` on each transformer block and on the root, over `dp_shard` (HSDP over
`dp_replicate` x `dp_shard` when dp_replicate > 1), with a mixed-precision policy."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.parallel import blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shard(model: nn.Module, mesh, cfg, device) -> None:
    """Shard `model` in place over the data-parallel dimensions of `mesh`."""
    dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    param = cfg.param_dtype if cfg.param_dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[cfg.reduce_dtype])
    layers = list(model.layers.values())
    for i, block in enumerate(layers):
        # The last block's parameters are needed again first in backward: keeping them saves an all-gather.
        fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=cfg.reshard_after_forward and i < len(layers) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)


def apply(model: nn.Module, mesh, cfg, device) -> nn.Module:
    blocks.apply(model, cfg)
    shard(model, mesh, cfg, device)
    model.to_empty(device=device)
    return model
