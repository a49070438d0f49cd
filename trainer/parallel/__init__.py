"""Parallelism strategies: each module's `apply(model, mesh, cfg, device)` takes the meta-device model and
returns it ready to train on `device` (storage allocated, weights not yet initialised; see
`trainer.models.init_weights`). `build_mesh` lays the world out as a named DeviceMesh.
"""

from __future__ import annotations

import contextlib
import importlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def build_mesh(cfg, world_size: int, device_type: str) -> DeviceMesh:
    """The world as a DeviceMesh with named dimensions; DDP replicates over all of it."""
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_replicate",))


def apply(model: nn.Module, mesh: DeviceMesh, cfg, device) -> nn.Module:
    module = importlib.import_module(f"trainer.parallel.{cfg.name}")
    return module.apply(model, mesh, cfg, device)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any wrapper a strategy added."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def no_grad_sync(model: nn.Module):
    """A context in which backward accumulates gradients locally without reducing them across ranks."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
