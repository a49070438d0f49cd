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

from ops.pointwise_codegen import expression_bodies


@triton.jit
def _expm1(x):
    # Kahan's: exact near 0, where exp(x) - 1 cancels.
    u = tl.exp(x)
    small = (u == 1.0) | (x != x)
    return tl.where(small, x, tl.where(u - 1.0 == -1.0, -1.0, (u - 1.0) * x / tl.log(u)))


@triton.jit
def _log1p(x):
    # Goldberg's: log(1 + x) * x / ((1 + x) - 1) keeps the digits of small x.
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * x / (u - 1.0))


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
def _sinc(x):
    p = x * 3.141592653589793
    return tl.where(x == 0, 1.0, tl.sin(p) / p)


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


expression_bodies(globals(), {
    # --- unary, float results ----------------------------------------------------------------------------------
    "_exp(x)": "tl.exp(x)",
    "_exp2(x)": "tl.exp2(x)",
    "_log(x)": "tl.log(x)",
    "_log2(x)": "tl.log2(x)",
    "_log10(x)": "tl.log(x) / 2.302585092994046",
    "_sqrt(x)": "tl.sqrt(x)",
    "_rsqrt(x)": "1.0 / tl.sqrt(x)",
    "_sin(x)": "tl.sin(x)",
    "_cos(x)": "tl.cos(x)",
    "_tan(x)": "tl.sin(x) / tl.cos(x)",
    "_sinh(x)": "0.5 * (_expm1(x) - _expm1(-x))",
    "_cosh(x)": "0.5 * (tl.exp(x) + tl.exp(-x))",
    "_acosh(x)": "tl.log(x + tl.sqrt(x * x - 1.0))",
    "_atanh(x)": "0.5 * _log1p(2.0 * x / (1.0 - x))",
    "_sigmoid(x)": "1.0 / (1.0 + tl.exp(-x))",
    "_erf(x)": "tl.erf(x)",
    "_erfc(x)": "1.0 - tl.erf(x)",
    "_reciprocal(x)": "1.0 / x",
    "_deg2rad(x)": "x * 0.017453292519943295",
    "_rad2deg(x)": "x * 57.29577951308232",
    # --- unary, the operand's dtype ----------------------------------------------------------------------------
    "_abs(x)": "tl.abs(x)",
    "_neg(x)": "-x",
    "_sign(x)": "tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(x.dtype)",  # NaN: 0, as ATen's (0 < x) - (x < 0)
    "_floor(x)": "tl.floor(x) if x.dtype.is_floating() else x",
    "_ceil(x)": "tl.ceil(x) if x.dtype.is_floating() else x",
    "_trunc(x)": "tl.where(x < 0, tl.ceil(x), tl.floor(x)) if x.dtype.is_floating() else x",
    "_frac(x)": "x - _trunc(x)",
    "_relu(x)": "tl.where(x > 0, x, tl.where(x != x, x, 0))",
    "_bitwise_not(x)": "~x",
    # --- unary, bool results -----------------------------------------------------------------------------------
    "_logical_not(x)": "x == 0",
    "_isnan(x)": "x != x",
    "_isinf(x)": '(x == float("inf")) | (x == float("-inf"))',
    "_isposinf(x)": 'x == float("inf")',
    "_isneginf(x)": 'x == float("-inf")',
    "_signbit(x)": "(x < 0) | ((x == 0) & (1.0 / x < 0))",
})


SPECS = {
    **{name: (globals()[f"_{name}"], "float") for name in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "sinh", "cosh",
        "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc", "reciprocal", "deg2rad", "rad2deg", "sinc")},
    **{name: (globals()[f"_{name}"], "default") for name in (
        "abs", "neg", "sign", "floor", "ceil", "trunc", "round", "frac", "relu", "bitwise_not")},
    **{name: (globals()[f"_{name}"], "bool") for name in (
        "logical_not", "isnan", "isinf", "isposinf", "isneginf", "signbit")},
}
