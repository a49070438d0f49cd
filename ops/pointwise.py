"""`@pointwise`: a scalar `@triton.jit` function becomes a whole elementwise op, as FlagGems'
`pointwise_dynamic` does.

The op broadcasts its tensor inputs, takes inputs of any strides (gathering strided ones into one
contiguous buffer first), promotes their dtypes by torch's rules (`promote="float"`: integer results
become the default float dtype, as for activations), allocates the output, and runs the function in fp32
over blocks of elements. The scalar function receives fp32 values and returns one fp32 value.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

BLOCK = 1024


@triton.jit
def _unary(x_ptr, out_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, FN(x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _binary(x_ptr, y_ptr, out_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, FN(x, y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ternary(x_ptr, y_ptr, z_ptr, out_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, FN(x, y, z).to(out_ptr.dtype.element_ty), mask=mask)


_KERNELS = {1: _unary, 2: _binary, 3: _ternary}
# torch's own n-ary promotion rules, as its reference ops use them.
KIND = {"default": ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT, "float": ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT}


def pointwise(arity: int, promote: str = "default"):
    """Decorate a scalar `@triton.jit` function of `arity` fp32 arguments into an elementwise op."""
    if promote not in KIND:
        raise ValueError(f"promote={promote!r}: use 'default' or 'float'")
    if arity not in _KERNELS:
        raise ValueError(f"pointwise ops take 1 to 3 tensors, not {arity}")
    kernel = _KERNELS[arity]

    def wrap(fn):
        @functools.wraps(fn)
        def op(*args):
            if len(args) != arity:
                raise TypeError(f"{fn.__name__} takes {arity} tensors, got {len(args)}")
            tensors = [a if isinstance(a, torch.Tensor) else torch.tensor(a) for a in args]
            device = next((t.device for t in tensors if t.dim() > 0), tensors[0].device)
            _, dtype = elementwise_dtypes(*args, type_promotion_kind=KIND[promote])
            shaped = torch.broadcast_tensors(*[t.to(device) for t in tensors])
            out = torch.empty(shaped[0].shape, dtype=dtype, device=device)
            n = out.numel()
            if n:
                flat = [t.contiguous().view(-1) for t in shaped]
                kernel[(triton.cdiv(n, BLOCK),)](*flat, out.view(-1), n, FN=fn, BLOCK=BLOCK)
            return out

        op.scalar_fn = fn
        return op

    return wrap


# Binary ops generated from scalar functions (torch's promotion: int + int stays int; `div` is true division).


@pointwise(2)
@triton.jit
def add(x, y):
    return x + y


@pointwise(2)
@triton.jit
def sub(x, y):
    return x - y


@pointwise(2)
@triton.jit
def mul(x, y):
    return x * y


@pointwise(2, "float")
@triton.jit
def div(x, y):
    return x / y


@pointwise(2)
@triton.jit
def maximum(x, y):
    return tl.maximum(x, y)
