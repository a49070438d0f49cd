"""Parallelism: `ParallelDims` (the degrees and the mesh), `parallelize` (applies them to the model), and
what the loop needs from a parallelized model (gradient accumulation without sync, whole-model clipping).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.parallel.dims import ParallelDims
from trainer.parallel.expert_parallel import EXPERT_GROUP
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
    norms add up over the pipeline. Under expert parallelism each rank holds some experts, on a mesh of their own:
    their squared norms add up over the expert-parallel ranks.
    """
    params = [p for p in params if p.grad is not None]
    experts = [p for p in params if hasattr(p, EXPERT_GROUP)]
    rest = [p for p in params if not hasattr(p, EXPERT_GROUP)]
    total = _norm(rest)
    if experts:
        squares = _norm(experts) ** 2
        dist.all_reduce(squares, group=getattr(experts[0], EXPERT_GROUP))
        total = (total ** 2 + squares).sqrt()
    if pipeline is not None:
        total = pipeline.total(total.float() ** 2).sqrt()
    for group in (rest, experts):  # the experts' gradients live on a mesh of their own: clipped apart
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def _norm(params: list) -> torch.Tensor:
    """The 2-norm of `params`' gradients, whole (a sharded gradient's reduced across its mesh)."""
    total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    return total.full_tensor() if isinstance(total, DTensor) else total
