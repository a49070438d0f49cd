"""Parallelism strategies. Each module's `apply(model, mesh, cfg, device)` takes the meta-device model
and returns it ready to train on `device` (storage allocated, weights not yet initialised: see
`trainer.models.init_weights`, which gives every strategy the same weights).

The mesh always has the three named dimensions `dp_replicate`, `dp_shard` and `tp` (some of size 1).
Ranks that differ only in their `tp` coordinate share each batch.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.config import DEGREES, mesh_degrees


def build_mesh(cfg, world_size: int, device_type: str) -> DeviceMesh:
    d = mesh_degrees(cfg, world_size)
    return init_device_mesh(device_type, tuple(d[n] for n in DEGREES), mesh_dim_names=DEGREES)


def data_parallel_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this rank among those that see different data."""
    shard = mesh["dp_shard"]
    rank = mesh["dp_replicate"].get_local_rank() * shard.size() + shard.get_local_rank()
    return rank, mesh["dp_replicate"].size() * shard.size()


def apply(model: nn.Module, mesh: DeviceMesh, cfg, device) -> nn.Module:
    module = importlib.import_module(f"trainer.parallel.{cfg.name}")
    return module.apply(model, mesh, cfg, device)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any wrapper a strategy added (DDP wraps; FSDP2 and TP work in place)."""
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


@contextlib.contextmanager
def no_grad_sync(model: nn.Module):
    """Backward accumulates gradients locally, without reducing them across ranks (accumulation steps)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """Clip gradients to a total 2-norm of `max_norm` and return the norm before clipping.

    With sharded (DTensor) gradients, each shard's norm is partial; `full_tensor()` reduces it across the
    mesh, so the norm, and so the clipping, is that of the whole model on every rank.
    """
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
