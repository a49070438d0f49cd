"""The one-operand pointwise bodies: math with float results (exp, log, the trigonometric and hyperbolic
functions, sigmoid, erf, ...), rounding and sign in the operand's dtype, and tests with bool results (isnan,
signbit, ...). `ops.pointwise_ops` makes each body a whole op; `SPECS` gives each its name and type promotion.

A body receives its operands in the compute dtype (fp32 for fp32/fp16/bf16, fp64 for fp64, int64 for integers
and bools) and returns the value that is cast to the result dtype. Only `triton.language`'s core math is used
(no libdevice): the interpreter has no libdevice, and the same body must run there and compile for a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

# --- unary, float results ----------------------------------------------------------------------------------


@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _exp2(x):
    return tl.exp2(x)


@triton.jit
def _expm1(x):
    # Kahan's: exact near 0, where exp(x) - 1 cancels.
    u = tl.exp(x)
    small = (u == 1.0) | (x != x)
    return tl.where(small, x, tl.where(u - 1.0 == -1.0, -1.0, (u - 1.0) * x / tl.log(u)))


@triton.jit
def _log(x):
    return tl.log(x)


@triton.jit
def _log2(x):
    return tl.log2(x)


@triton.jit
def _log10(x):
    return tl.log(x) / 2.302585092994046


@triton.jit
def _log1p(x):
    # Goldberg's: log(1 + x) * x / ((1 + x) - 1) keeps the digits of small x.
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * x / (u - 1.0))


@triton.jit
def _sqrt(x):
    return tl.sqrt(x)


@triton.jit
def _rsqrt(x):
    return 1.0 / tl.sqrt(x)


@triton.jit
def _sin(x):
    return tl.sin(x)


@triton.jit
def _cos(x):
    return tl.cos(x)


@triton.jit
def _tan(x):
    return tl.sin(x) / tl.cos(x)


@triton.jit
def _sinh(x):
    return 0.5 * (_expm1(x) - _expm1(-x))


@triton.jit
def _cosh(x):
    return 0.5 * (tl.exp(x) + tl.exp(-x))


@triton.jit
def _tanh(x):
    # From e^(-2|x|): no overflow, the sign put back.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    small = tl.abs(x) < 0.0004
    return tl.where(small, x, tl.where(x < 0, -t, t))


@triton.jit
def _asinh(x):
    a = tl.abs(x)
    r = _log1p(a + a * a / (1.0 + tl.sqrt(1.0 + a * a)))
    return tl.where(x < 0, -r, r)


@triton.jit
def _acosh(x):
    return tl.log(x + tl.sqrt(x * x - 1.0))


@triton.jit
def _atanh(x):
    return 0.5 * _log1p(2.0 * x / (1.0 - x))


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _erf(x):
    return tl.erf(x)


@triton.jit
def _erfc(x):
    return 1.0 - tl.erf(x)


@triton.jit
def _reciprocal(x):
    return 1.0 / x


@triton.jit
def _deg2rad(x):
    return x * 0.017453292519943295


@triton.jit
def _rad2deg(x):
    return x * 57.29577951308232


@triton.jit
def _sinc(x):
    p = x * 3.141592653589793
    return tl.where(x == 0, 1.0, tl.sin(p) / p)


# --- unary, the operand's dtype ----------------------------------------------------------------------------


@triton.jit
def _abs(x):
    return tl.abs(x)


@triton.jit
def _neg(x):
    return -x


@triton.jit
def _sign(x):
    return tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(x.dtype) + tl.where(x != x, x, 0)


@triton.jit
def _floor(x):
    return tl.floor(x) if x.dtype.is_floating() else x


@triton.jit
def _ceil(x):
    return tl.ceil(x) if x.dtype.is_floating() else x


@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x)) if x.dtype.is_floating() else x


@triton.jit
def _round(x):
    # Half to even, as torch.round.
    if x.dtype.is_floating():
        r = tl.floor(x + 0.5)
        tie = (r - x) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
        return tl.where(tie & odd, r - 1.0, r)
    else:
        return x


@triton.jit
def _frac(x):
    return x - _trunc(x)


@triton.jit
def _relu(x):
    return tl.where(x > 0, x, tl.where(x != x, x, 0))


@triton.jit
def _bitwise_not(x):
    return ~x


# --- unary, bool results -----------------------------------------------------------------------------------


@triton.jit
def _logical_not(x):
    return x == 0


@triton.jit
def _isnan(x):
    return x != x


@triton.jit
def _isinf(x):
    return (x == float("inf")) | (x == float("-inf"))


@triton.jit
def _isposinf(x):
    return x == float("inf")


@triton.jit
def _isneginf(x):
    return x == float("-inf")


@triton.jit
def _signbit(x):
    return (x < 0) | ((x == 0) & (1.0 / x < 0))


SPECS = {
    **{name: (globals()[f"_{name}"], "float") for name in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "sinh", "cosh",
        "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc", "reciprocal", "deg2rad", "rad2deg", "sinc")},
    **{name: (globals()[f"_{name}"], "default") for name in (
        "abs", "neg", "sign", "floor", "ceil", "trunc", "round", "frac", "relu", "bitwise_not")},
    **{name: (globals()[f"_{name}"], "bool") for name in (
        "logical_not", "isnan", "isinf", "isposinf", "isneginf", "signbit")},
}
