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
(LoRA's, QAT's: they compute more than the product), under the CPU's autocast (train.mixed_precision=bf16: its
products are bfloat16), `mm`/`addmm` routed to our kernels, compiled blocks (strategy.compile: a method set on a
module makes torch.compile compile it again at every call), or a packed copy larger than a quarter of the memory
available (the kernel's MemAvailable, or a container's limit where that leaves less; said once in the log).
Layers with hooks are packed each, not fused, so the hooks run. oneDNN's product has no backward: a call with
autograd on takes the layer's own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.models.llama import Attention, FeedForward, TiedProjection

log = logging.getLogger(__name__)

MEMORY_SHARE = 4  # the packed copy may take at most 1/MEMORY_SHARE of the memory available
# A cgroup's memory limit and use: v2's files, then v1's.
CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
_SAID: list[int] = []  # the packed size the log gave, once, when too little memory was left for it
METHODS = {Attention: ("projections", ("wq", "wk", "wv")), FeedForward: ("gate_and_up", ("w1", "w3"))}


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not isinstance(weight, DTensor)


def _routed() -> bool:
    """Whether matrix products go to our kernels (`ops.use_kernels`): then they stay theirs."""
    aten = sys.modules.get("ops.aten")
    return aten is not None and any(name.split(".")[0] in ("mm", "addmm") for name in aten.registered())


def _compiled(model: nn.Module) -> bool:
    """Whether some module runs compiled (strategy.compile): methods set on its modules would make torch.compile
    guard on them and compile again at every call."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # no such file, or "max": no limit there


def _available_bytes() -> int:
    """The memory this process can still take: the kernel's MemAvailable (free memory and reclaimable caches),
    less where its cgroup (a container's limit, v2 or v1) leaves less; 0 where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in CGROUP_MEMORY:
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None:
            found.append(max(cap - used, 0))
    return min(found) if found else 0


def _fast(x: torch.Tensor) -> bool:
    """Whether a call may take the packed product: float32 input (not autocast's bfloat16), and no autograd
    (oneDNN's op has no backward: a caller computing gradients gets the layer's own product)."""
    return x.dtype == torch.float32 and not torch.is_grad_enabled()


def _linear(packed: torch.Tensor, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _fast(x):
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
    return nn.Linear.forward(layer, x)


def _fused(packed: torch.Tensor, bias: torch.Tensor | None, sizes: list[int], module: nn.Module, method: str,
           x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if _fast(x):
        return tuple(torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "").split(sizes, dim=-1))
    return getattr(type(module), method)(module, x)


def _tied(packed: torch.Tensor, source: torch.Tensor, layer: TiedProjection, h: torch.Tensor, weight: torch.Tensor
          ) -> torch.Tensor:
    if weight is source and _fast(h):
        return torch.ops.mkldnn._linear_pointwise(h, packed, None, "none", [], "")
    return TiedProjection.forward(layer, h, weight)


def _plain(linear: nn.Module) -> bool:
    """A layer the packing may take: an `nn.Linear` itself, with a float32 weight on the CPU, and no `forward` of
    its own already set on the object."""
    weight = getattr(linear, "weight", None)  # model.impl=transformers: a tied head holds none of its own
    return (type(linear) is nn.Linear and isinstance(weight, torch.Tensor) and _packable(weight)
            and "forward" not in vars(linear))


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
    `FeedForward.gate_and_up` are set on these module objects, so any caller of the model meanwhile runs them too:
    one with autograd on, or with other than float32 inputs, gets the layers' own products."""
    groups = []  # (module, its method the fused product replaces, the layers fused)
    for m in model.modules():
        method, names = METHODS.get(type(m), ("", ()))
        layers = [getattr(m, n) for n in names]
        if method and method not in vars(m) and _fusable(layers):
            groups.append((m, method, layers))
    fused = {id(linear) for _, _, linears in groups for linear in linears}
    linears = [m for m in model.modules() if _plain(m) and id(m) not in fused]
    tied = [m for m in model.modules() if isinstance(m, TiedProjection) and "forward" not in vars(m)]
    embedding = getattr(getattr(model, "tok_embeddings", None), "weight", None)
    if not (tied and embedding is not None and _packable(embedding)):
        tied = []
    size = sum(m.weight.nbytes for m in linears) + sum(m.weight.nbytes for _, _, ms in groups for m in ms)
    size += embedding.nbytes if tied else 0
    size += max((sum(m.weight.nbytes for m in ms) for _, _, ms in groups), default=0)  # a fused group's concatenation
    if (size == 0 or not torch.backends.mkldnn.is_available() or torch.is_autocast_enabled("cpu") or _routed()
            or _compiled(model)):
        yield
        return
    if size * MEMORY_SHARE > _available_bytes():
        if not _SAID:  # once a process: a run decodes at every step
            _SAID.append(size)
            log.info("decoding with the layers' own weights: packing them for oneDNN takes %.1f GB, over a quarter "
                     "of the memory available", size / 1e9)
        yield
        return
    replaced: list[tuple[nn.Module, str]] = []
    try:
        with torch.no_grad():
            for m in linears:
                m.forward = functools.partial(_linear, _pack([m.weight], rows), m)
                replaced.append((m, "forward"))
            for module, method, ms in groups:
                bias = None if ms[0].bias is None else torch.cat([m.bias for m in ms])
                setattr(module, method, functools.partial(_fused, _pack([m.weight for m in ms], rows), bias,
                                                          [m.out_features for m in ms], module, method))
                replaced.append((module, method))
            if tied:
                packed = _pack([embedding], rows)
                for m in tied:
                    m.forward = functools.partial(_tied, packed, embedding, m)
                    replaced.append((m, "forward"))
        yield
    finally:
        for module, method in replaced:
            vars(module).pop(method, None)  # another call on this model may have given it back already
