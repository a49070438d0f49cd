"""Parallelism: `ParallelDims` (the degrees and the mesh), `parallelize` (applies them to the model), and
what the loop needs from a parallelized model (gradient accumulation without sync, whole-model clipping).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.parallel.dims import ParallelDims
from trainer.parallel.parallelize import parallelize, uses_loss_parallel

__all__ = ["ParallelDims", "clip_grad_norm_", "no_grad_sync", "parallelize", "uses_loss_parallel"]


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


def clip_grad_norm_(params, max_norm: float, pipeline=None) -> torch.Tensor:
    """Clip gradients to a total 2-norm of `max_norm` and return the norm before clipping.

    With sharded (DTensor) gradients, each shard's norm is partial; `full_tensor()` reduces it across the
    mesh, so the norm, and so the clipping, is that of the whole model on every rank. Under pipeline
    parallelism (`pipeline`, a `trainer.parallel.pipeline.Pipeline`) each rank holds some stages: their squared
    norms add up over the pipeline.
    """
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pipeline is not None:
        total = pipeline.total(total.float() ** 2).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
