"""The two-operand pointwise bodies: arithmetic, minimum and maximum, bitwise and shifts, pow, comparisons
and logical ones. `ops.pointwise_ops` makes each body a whole op; `SPECS` gives each its name and type
promotion. They compute as `ops.unary_ops`' bodies do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ops.pointwise_codegen import expression_bodies
from ops.unary_ops import _log1p, _signbit, _trunc


@triton.jit
def _div_trunc(x, y):
    if x.dtype.is_floating():
        return _trunc(x / y)
    else:
        return x // y


@triton.jit
def _floor_divide(x, y):
    if x.dtype.is_floating():
        return tl.floor(x / y)
    else:
        q = x // y  # C's: towards zero
        return q - (((x % y) != 0) & ((x < 0) != (y < 0))).to(q.dtype)


@triton.jit
def _remainder(x, y):
    if x.dtype.is_floating():
        return x - tl.floor(x / y) * y
    else:
        r = x % y
        return tl.where((r != 0) & ((r < 0) != (y < 0)), r + y, r)


@triton.jit
def _fmod(x, y):
    if x.dtype.is_floating():
        return x - _trunc(x / y) * y
    else:
        return x % y


@triton.jit
def _copysign(x, y):
    a = tl.abs(x)
    return tl.where(_signbit(y), -a, a)


@triton.jit
def _logaddexp(x, y):
    m = tl.maximum(x, y)
    return tl.where(tl.abs(m) == float("inf"), m, m + _log1p(tl.exp(-tl.abs(x - y))))


@triton.jit
def _logaddexp2(x, y):
    m = tl.maximum(x, y)
    return tl.where(tl.abs(m) == float("inf"), m, m + _log1p(tl.exp2(-tl.abs(x - y))) / 0.6931471805599453)


@triton.jit
def _pow(x, y):
    if x.dtype.is_floating():
        whole = tl.floor(y) == y
        odd = whole & ((y - 2.0 * tl.floor(y * 0.5)) != 0)
        r = tl.exp(y * tl.log(tl.abs(x)))
        r = tl.where(x < 0, tl.where(whole, tl.where(odd, -r, r), float("nan")), r)
        r = tl.where(y == 2.0, x * x, tl.where(y == 1.0, x, r))
        return tl.where((y == 0) | (x == 1.0), 1.0, r)
    else:
        xf = x.to(tl.float64)
        r = tl.exp(y.to(tl.float64) * tl.log(tl.abs(xf)))
        odd = (y % 2) != 0
        r = tl.where((x < 0) & odd, -r, r)
        return tl.where(y == 0, 1, tl.where(y < 0, tl.where(tl.abs(x) == 1, r, 0.0), r + tl.where(r < 0, -0.5, 0.5)))


expression_bodies(globals(), {
    "_add(x, y)": "x + y",
    "_sub(x, y)": "x - y",
    "_mul(x, y)": "x * y",
    "_div(x, y)": "x / y",
    "_maximum(x, y)": "tl.where((x != x) | (x > y), x, y)",
    "_minimum(x, y)": "tl.where((x != x) | (x < y), x, y)",
    "_fmax(x, y)": "tl.where((y != y) | (x > y), x, y)",
    "_fmin(x, y)": "tl.where((y != y) | (x < y), x, y)",
    "_bitwise_and(x, y)": "x & y",
    "_bitwise_or(x, y)": "x | y",
    "_bitwise_xor(x, y)": "x ^ y",
    "_left_shift(x, y)": "x << y",
    "_right_shift(x, y)": "x >> y",
    "_hypot(x, y)": "tl.sqrt(x * x + y * y)",
    "_xlogy(x, y)": "tl.where(y != y, y, tl.where(x == 0, 0.0, x * tl.log(y)))",
    "_heaviside(x, y)": "tl.where(x == 0, y, tl.where(x > 0, 1, 0).to(x.dtype))",
    "_eq(x, y)": "x == y",
    "_ne(x, y)": "x != y",
    "_lt(x, y)": "x < y",
    "_le(x, y)": "x <= y",
    "_gt(x, y)": "x > y",
    "_ge(x, y)": "x >= y",
    "_logical_and(x, y)": "(x != 0) & (y != 0)",
    "_logical_or(x, y)": "(x != 0) | (y != 0)",
    "_logical_xor(x, y)": "(x != 0) != (y != 0)",
})


SPECS = {
    **{name: (globals()[f"_{name}"], "float") for name in (
        "div", "copysign", "hypot", "xlogy", "logaddexp", "logaddexp2")},
    **{name: (globals()[f"_{name}"], "default") for name in (
        "add", "sub", "mul", "div_trunc", "floor_divide", "remainder", "fmod", "maximum", "minimum", "fmax", "fmin",
        "bitwise_and", "bitwise_or", "bitwise_xor", "heaviside", "pow", "left_shift", "right_shift")},
    **{name: (globals()[f"_{name}"], "bool") for name in (
        "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor")},
}
