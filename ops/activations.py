"""Activations and the gated-MLP cores (SwiGLU, GeGLU), forward and backward, built with `@pointwise`;
a gated op's backward is one launch that writes both input gradients.

`silu_and_mul(x, y) = silu(x) * y` is the SwiGLU core of a Llama MLP; `gelu_and_mul` is GeGLU's.
`approximate` is "none" (erf) or "tanh", as in `torch.nn.functional.gelu`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.pointwise_codegen import pointwise

# A @triton.jit function may read a module global only when it is a `tl.constexpr` (the interpreter
# accepts any global; the compiler does not). Each multiplies a tensor from the right: the interpreter
# wraps `constexpr * tensor` into a constexpr.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def _dsilu(x):
    s = tl.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@triton.jit
def _gelu_erf(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * INV_SQRT_2))


@triton.jit
def _dgelu_erf(x):
    return 0.5 * (1.0 + tl.math.erf(x * INV_SQRT_2)) + x * INV_SQRT_2PI * tl.exp(-0.5 * x * x)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gelu_tanh(x):
    return 0.5 * x * (1.0 + _tanh((x + 0.044715 * x * x * x) * SQRT_2_OVER_PI))


@triton.jit
def _dgelu_tanh(x):
    t = _tanh((x + 0.044715 * x * x * x) * SQRT_2_OVER_PI)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)


silu_fwd = pointwise(promote="float")(_silu)
gelu_fwd = pointwise(promote="float")(_gelu_erf)
gelu_tanh_fwd = pointwise(promote="float")(_gelu_tanh)


@pointwise(promote="float")
@triton.jit
def silu_bwd(x, g):
    return g * _dsilu(x)


@pointwise(promote="float")
@triton.jit
def gelu_bwd(x, g):
    return g * _dgelu_erf(x)


@pointwise(promote="float")
@triton.jit
def gelu_tanh_bwd(x, g):
    return g * _dgelu_tanh(x)


@pointwise(promote="float")
@triton.jit
def silu_mul_fwd(x, y):
    return _silu(x) * y


@pointwise(promote="float")
@triton.jit
def gelu_mul_fwd(x, y):
    return _gelu_erf(x) * y


@pointwise(promote="float")
@triton.jit
def gelu_tanh_mul_fwd(x, y):
    return _gelu_tanh(x) * y


# The gated backward: both input gradients in one pass over x, y and g.


@pointwise(promote="float", outputs=2)
@triton.jit
def silu_mul_bwd(x, y, g):
    return g * y * _dsilu(x), g * _silu(x)


@pointwise(promote="float", outputs=2)
@triton.jit
def gelu_mul_bwd(x, y, g):
    return g * y * _dgelu_erf(x), g * _gelu_erf(x)


@pointwise(promote="float", outputs=2)
@triton.jit
def gelu_tanh_mul_bwd(x, y, g):
    return g * y * _dgelu_tanh(x), g * _gelu_tanh(x)


_GELU = {"none": (gelu_fwd, gelu_bwd, gelu_mul_fwd, gelu_mul_bwd),
         "tanh": (gelu_tanh_fwd, gelu_tanh_bwd, gelu_tanh_mul_fwd, gelu_tanh_mul_bwd)}


def _gelu_kernels(approximate: str):
    if approximate not in _GELU:
        raise ValueError(f"approximate={approximate!r}: use 'none' or 'tanh'")
    return _GELU[approximate]


class _Unary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.save_for_backward(x)
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return ctx.bwd(x, g).to(x.dtype), None, None


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, fwd, bwd):
        ctx.save_for_backward(x, y)
        ctx.bwd = bwd
        return fwd(x, y)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        gx, gy = ctx.bwd(x, y, g)
        return gx.to(x.dtype), gy.to(y.dtype), None, None


def silu(x: torch.Tensor) -> torch.Tensor:
    return _Unary.apply(x, silu_fwd, silu_bwd)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    fwd, bwd, _, _ = _gelu_kernels(approximate)
    return _Unary.apply(x, fwd, bwd)


def silu_and_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """silu(x) * y."""
    return _Gated.apply(x, y, silu_mul_fwd, silu_mul_bwd)


def gelu_and_mul(x: torch.Tensor, y: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x, approximate) * y."""
    _, _, mul_fwd, mul_bwd = _gelu_kernels(approximate)
    return _Gated.apply(x, y, mul_fwd, mul_bwd)
