"""DistributedDataParallel over `dp_replicate`: each rank holds the whole model, gradients are averaged."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.parallel import blocks


def apply(model: nn.Module, mesh, cfg, device) -> nn.Module:
    blocks.apply(model, cfg)
    model.to_empty(device=device)
    dp = mesh["dp_replicate"]
    if dp.size() == 1:
        # Nothing to average with a single replica; skipping the wrapper saves its bucket copies.
        return model
    return DistributedDataParallel(model, process_group=dp.get_group(), bucket_cap_mb=cfg.bucket_cap_mb,
                                   device_ids=[device] if device.type == "cuda" else None)
