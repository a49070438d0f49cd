"""2-D parallelism: tensor parallelism inside groups of `tp` ranks (keep them within a node), FSDP2
across the groups, in TorchTitan's order: TP plan, then block options, then sharding."""

from __future__ import annotations

from torch import nn

from trainer.parallel import blocks, fsdp2, tp


def apply(model: nn.Module, mesh, cfg, device) -> nn.Module:
    tp.parallelize(model, mesh["tp"], cfg)
    blocks.apply(model, cfg)
    fsdp2.shard(model, mesh, cfg, device)
    model.to_empty(device=device)
    return model
