"""One kernel launch over many tensors, as torch's `_foreach_*` ops and apex's `multi_tensor_apply` do: the
kernels take tables of the tensors' addresses and sizes, and one program per block of any of them (which
tensor, and where in it, from two more tables). The optimizer step, the gradient norm and the clipping
scale of a whole model are each one launch.

Ops here: `foreach_norm(tensors)` (each tensor's 2-norm, as `torch._foreach_norm`), `vector_norm` (the
2-norm of one tensor over all or some dimensions, as `torch.linalg.vector_norm`), `foreach_mul_(tensors,
scale)` (each multiplied in place by one scalar tensor, as `torch._foreach_mul_`), and `stack` (as
`torch.stack`). The sums are deterministic: each block's sum of squares is written apart, then each
tensor's blocks are summed in order.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from ops.settings import POINTWISE_BLOCK, warps

TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def table(values, device: torch.device) -> torch.Tensor:
    """An int64 table of kernel arguments (addresses, sizes) on `device`. Made from numpy: it is the
    kernel's argument list, not a computation of the step."""
    t = torch.from_numpy(np.asarray(values, dtype=np.int64))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


@functools.lru_cache(maxsize=64)
def _blocks(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    counts = [triton.cdiv(n, POINTWISE_BLOCK) for n in sizes]
    owner = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    start = np.concatenate([np.arange(c, dtype=np.int64) * POINTWISE_BLOCK for c in counts] or [np.zeros(0)])
    return table(sizes, device), table(owner, device), table(start, device), len(owner)


def blocks(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(the sizes, which tensor each block belongs to, where in it the block starts, the number of blocks),
    kept for the next call with the same sizes (every step of a model's optimizer and clipping)."""
    return _blocks(tuple(sizes), device)


@functools.lru_cache(maxsize=256)
def _addresses(pointers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return table(pointers, device)


def addresses(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' addresses as a table (kept: parameters and moments stay where they are, and the caching
    allocator gives gradients the same addresses step after step)."""
    return _addresses(tuple(t.data_ptr() for t in tensors), device)


@triton.jit
def _sumsq_blocks(x_table, sizes, block_tensor, block_start, partial_ptr, T: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    t = tl.load(block_tensor + block)
    offs = tl.load(block_start + block) + tl.arange(0, BLOCK).to(tl.int64)
    x_ptr = tl.load(x_table + t).to(tl.pointer_type(T))
    x = tl.load(x_ptr + offs, mask=offs < tl.load(sizes + t), other=0.0).to(tl.float32)
    tl.store(partial_ptr + block, tl.sum(x * x, axis=0))


@triton.jit
def _segment_norms(partial_ptr, first_block, n_blocks, out_ptr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    first = tl.load(first_block + t)
    count = tl.load(n_blocks + t)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, count, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + first + offs, mask=offs < count, other=0.0)
    tl.store(out_ptr + t, tl.sqrt(tl.sum(acc, axis=0)).to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=64)
def _segments(counts: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tensor's first block and number of blocks."""
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return table(first, device), table(counts, device)


def _norms(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The 2-norms of same-dtype, contiguous tensors on one device, as one (len,) tensor of `dtype`."""
    device = tensors[0].device
    sizes = [t.numel() for t in tensors]
    size_table, owner, start, n = blocks(sizes, device)
    partial = torch.empty(n, dtype=torch.float32, device=device)
    if n:
        _sumsq_blocks[(n,)](addresses(tensors, device), size_table, owner, start, partial,
                            T=TL[tensors[0].dtype], BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))
    counts = [triton.cdiv(s, POINTWISE_BLOCK) for s in sizes]
    out = torch.empty(len(tensors), dtype=dtype, device=device)
    _segment_norms[(len(tensors),)](partial, *_segments(tuple(counts), device), out, BLOCK=256, num_warps=warps(256))
    return out


def _floating(tensors: list[torch.Tensor], op: str) -> None:
    for t in tensors:
        if t.dtype not in TL:
            raise ValueError(f"{op}: {t.dtype} tensors; the kernels take fp32, bf16 and fp16")


def foreach_norm(tensors: list[torch.Tensor], ord=2, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """`torch._foreach_norm`: each tensor's 2-norm (0-d, in the tensor's dtype or `dtype`), one launch per
    device and dtype (two, with the ordered sum of the blocks)."""
    if ord != 2:
        raise ValueError(f"foreach_norm: ord={ord}; the kernels compute 2-norms")
    _floating(tensors, "foreach_norm")
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for (_, kind), idx in groups.items():
        norms = _norms([tensors[i].contiguous() for i in idx], dtype or kind)
        for i, norm in zip(idx, norms.unbind(0), strict=True):
            out[i] = norm
    return out


def vector_norm(x: torch.Tensor, ord=2, dim=None, keepdim: bool = False, dtype: torch.dtype | None = None):
    """`torch.linalg.vector_norm` for ord=2: over every dimension with the multi-block sum, over some with
    the row sum of squares (`ops.reductions`)."""
    from ops import reductions

    if ord != 2:
        raise ValueError(f"vector_norm: ord={ord}; the kernels compute 2-norms")
    _floating([x], "vector_norm")
    dims = reductions._dims(x, dim)
    if len(dims) == x.dim():
        norm = _norms([x.contiguous()], dtype or x.dtype)[0]
        return norm.reshape([1] * x.dim()) if keepdim else norm
    return reductions._sum(x, dims, keepdim, dtype, squares=True)


@triton.jit
def _scale_(x_table, sizes, block_tensor, block_start, scale_ptr, T: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    t = tl.load(block_tensor + block)
    offs = tl.load(block_start + block) + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < tl.load(sizes + t)
    x_ptr = tl.load(x_table + t).to(tl.pointer_type(T))
    scale = tl.load(scale_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + offs, (x * scale).to(T), mask=mask)


def foreach_mul_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """`torch._foreach_mul_(tensors, scale)` for a one-element tensor `scale`: in place, computed in fp32,
    one launch per device and dtype. Tensors must be contiguous (gradients are)."""
    if scale.numel() != 1:
        raise ValueError(f"foreach_mul_: scale of shape {tuple(scale.shape)}; one element")
    _floating(tensors, "foreach_mul_")
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"foreach_mul_: a non-contiguous tensor {tuple(t.shape)} cannot be scaled in place")
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, kind), ts in groups.items():
        sizes, owner, start, n = blocks([t.numel() for t in ts], device)
        _scale_[(n,)](addresses(ts, device), sizes, owner, start, scale.to(device), T=TL[kind],
                      BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))


@triton.jit
def _stack(x_table, block_tensor, block_start, out_ptr, n, n_tensors, inner, T: tl.constexpr,
           BLOCK: tl.constexpr):
    block = tl.program_id(0)
    t = tl.load(block_tensor + block)
    offs = tl.load(block_start + block) + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    x_ptr = tl.load(x_table + t).to(tl.pointer_type(T))
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    # Element (a, b) of tensor t, viewed as (outer, inner), lands at (a, t, b) of the result.
    dst = (offs // inner) * (n_tensors * inner) + t * inner + offs % inner
    tl.store(out_ptr + dst, x, mask=mask)


def stack(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """`torch.stack`: same-shape tensors along a new dimension `dim`, in the promoted dtype, one launch."""
    if not tensors:
        raise ValueError("stack: expects a non-empty list of tensors")
    shape = tensors[0].shape
    if any(t.shape != shape for t in tensors):
        raise ValueError(f"stack: every tensor must have shape {tuple(shape)}, got "
                         f"{[tuple(t.shape) for t in tensors]}")
    dim = dim % (len(shape) + 1)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    device = tensors[0].device
    out = torch.empty(*shape[:dim], len(tensors), *shape[dim:], dtype=dtype, device=device)
    n = tensors[0].numel()
    if n:
        if dtype not in TL:
            raise ValueError(f"stack: {dtype} tensors; the kernel copies fp32, bf16 and fp16")
        sources = [t.to(dtype).contiguous() for t in tensors]
        inner = 1
        for size in shape[dim:]:
            inner *= size
        _, owner, start, count = blocks([n] * len(sources), device)
        _stack[(count,)](addresses(sources, device), owner, start, out, n, len(sources), inner, T=TL[dtype],
                         BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))
    return out
