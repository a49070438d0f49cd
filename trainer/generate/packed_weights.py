"""oneDNN's prepacked weights for the linear layers of a decode on a CPU.

A decode step multiplies a few rows (one token per row of the batch) by every weight of the model. On a CPU,
PyTorch's `linear` hands that to MKL's GEMM; oneDNN's kernels over a weight laid out once in its blocked format
(`mkldnn::_reorder_linear_weight`, which `torch.compile`'s CPU freezing packs weights with) take less: at 16
rows on 2 cores, 0.34 ms against 0.92 for an 8192x256 output layer, 56 us against 72 for a 768x256 layer.
`packed_linears` packs a model's `nn.Linear` weights (and a tied output's embedding) when a `generate` call
starts, runs the call's layers on them (`mkldnn::_linear_pointwise`), an attention's query, key and value layers
as one product (`Attention.projections`) and a feed-forward's gate and up layers as one (`FeedForward.gate_and_up`),
and gives the layers back as they were when it ends. The weights are packed again at each call (a few ms), so a
policy trained between two calls samples from its new weights, and the packed copy lives only during the call.

It leaves a model as it is where the packing does not apply: off the CPU, without oneDNN, weights other than
float32 (the dtype checked to give transformers' tokens), sharded (DTensor) weights, a subclass of `nn.Linear`
(LoRA's, QAT's: they compute more than the product), `mm`/`addmm` routed to our kernels, or a packed copy
larger than a quarter of the memory available. Layers with hooks are packed each, not fused, so the hooks run.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.models.llama import Attention, FeedForward, TiedProjection

MEMORY_SHARE = 4  # the packed copy may take at most 1/MEMORY_SHARE of the memory available


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not isinstance(weight, DTensor)


def _routed() -> bool:
    """Whether matrix products go to our kernels (`ops.use_kernels`): then they stay theirs."""
    aten = sys.modules.get("ops.aten")
    return aten is not None and any(name.split(".")[0] in ("mm", "addmm") for name in aten.registered())


def _available_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _linear(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _tied(packed: torch.Tensor, source: torch.Tensor, original, h: torch.Tensor, weight: torch.Tensor
          ) -> torch.Tensor:
    return _linear(packed, None, h) if weight is source else original(h, weight)


def _fused(packed: torch.Tensor, bias: torch.Tensor | None, sizes: list[int], x: torch.Tensor
           ) -> tuple[torch.Tensor, ...]:
    return tuple(_linear(packed, bias, x).split(sizes, dim=-1))


def _plain(linear: nn.Module) -> bool:
    """A layer the packing may take: an `nn.Linear` itself, with a float32 weight on the CPU."""
    weight = getattr(linear, "weight", None)  # model.impl=transformers: a tied head holds none of its own
    return type(linear) is nn.Linear and isinstance(weight, torch.Tensor) and _packable(weight)


def _fusable(linears: list[nn.Module]) -> bool:
    """Layers whose products can be one: plain, hooked by nothing (one product would skip their hooks), and all
    with a bias or none."""
    return (all(_plain(m) and not m._forward_hooks and not m._forward_pre_hooks for m in linears)
            and len({m.bias is None for m in linears}) == 1)


def _pack(weights: list[torch.Tensor], rows: int) -> torch.Tensor:
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int) -> Iterator[None]:
    """Inside the block, `model`'s float32 `nn.Linear` layers (and a tied output) on the CPU multiply by
    weights packed for about `rows` rows; an attention's query, key and value layers are one product, and so are
    a feed-forward's gate and up layers. The layers' `forward`, `Attention.projections` and
    `FeedForward.gate_and_up` are set on these module objects: any caller of the model meanwhile runs them too
    (from the same weights, as long as nothing trains the model during the block)."""
    groups = [(m, "projections", [m.wq, m.wk, m.wv]) for m in model.modules() if isinstance(m, Attention)]
    groups += [(m, "gate_and_up", [m.w1, m.w3]) for m in model.modules() if isinstance(m, FeedForward)]
    groups = [g for g in groups if _fusable(g[2])]
    fused = {id(linear) for _, _, linears in groups for linear in linears}
    linears = [m for m in model.modules() if _plain(m) and id(m) not in fused]
    tied = [m for m in model.modules() if isinstance(m, TiedProjection)]
    embedding = getattr(getattr(model, "tok_embeddings", None), "weight", None)
    if not (tied and embedding is not None and _packable(embedding)):
        tied = []
    size = sum(m.weight.nbytes for m in linears) + sum(m.weight.nbytes for _, _, ms in groups for m in ms)
    size += embedding.nbytes if tied else 0
    if size == 0 or not torch.backends.mkldnn.is_available() or _routed() or size * MEMORY_SHARE > _available_bytes():
        yield
        return
    replaced: list[tuple[nn.Module, str]] = []
    try:
        with torch.no_grad():
            for m in linears:
                m.forward = functools.partial(_linear, _pack([m.weight], rows), m.bias)
                replaced.append((m, "forward"))
            for module, method, ms in groups:
                bias = None if ms[0].bias is None else torch.cat([m.bias for m in ms])
                setattr(module, method, functools.partial(_fused, _pack([m.weight for m in ms], rows), bias,
                                                          [m.out_features for m in ms]))
                replaced.append((module, method))
            if tied:
                packed = _pack([embedding], rows)
                for m in tied:
                    m.forward = functools.partial(_tied, packed, embedding, type(m).forward.__get__(m))
                    replaced.append((m, "forward"))
        yield
    finally:
        for module, method in replaced:
            vars(module).pop(method, None)  # another call on this model may have given it back already
