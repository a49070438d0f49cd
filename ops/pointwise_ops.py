"""The pointwise ops: each one scalar `@triton.jit` body (those of `ops.unary_ops`, `ops.binary_ops`,
`ops.activation_ops`, and here the three-operand ones, selection, fill and copy) made a whole op by the generator
(`ops.pointwise_codegen`) from one row of `SPECS`: the op's name, its body and its type promotion.

`OPS[name]` is the generated op (`OPS["exp"](x)`, `OPS["add"](x, y, out=x)`); `add`, `clamp`, `where`, ... the
public ones `ops` exports; `into_self` runs an op in place. The ATen overloads they route are
`ops.pointwise_aten`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import activation_ops, binary_ops, unary_ops
from ops.pointwise_codegen import expression_bodies, pointwise


@triton.jit
def _lerp(x, y, w):
    # PyTorch's two-sided form: exact at both ends.
    return tl.where(tl.abs(w) < 0.5, x + w * (y - x), y - (y - x) * (1.0 - w))


@triton.jit
def _clamp(x, lo, hi):
    # torch.clamp's order (min first, then max: hi wins when lo > hi); a NaN stays NaN.
    y = tl.where(x < lo, lo, x)
    return tl.where(y > hi, hi, y)


@triton.jit
def _nan_to_num(x, nan, posinf, neginf):
    r = tl.where(x != x, nan, x)
    return tl.where(x == float("inf"), posinf, tl.where(x == float("-inf"), neginf, r))


@triton.jit
def _mse(x, y):
    d = x - y
    return d * d


expression_bodies(globals(), {
    "_addcmul(x, a, b, value)": "x + value * a * b",
    "_addcdiv(x, a, b, value)": "x + value * a / b",
    "_where(c, x, y)": "tl.where(c != 0, x, y)",
    "_clamp_min(x, lo)": "tl.where(x < lo, lo, x)",
    "_clamp_max(x, hi)": "tl.where(x > hi, hi, x)",
    "_fill(x, value)": "tl.zeros_like(x) + value",
    "_copy(x)": "x",
    "_mse_backward(g, x, y, scale)": "2.0 * scale * (x - y) * g",
    "_dropout_backward(g, mask, scale)": "g * mask * scale",
})


# name: (body, promotion: "default" (the operands' dtype), "float" (integers to float) or "bool" (a test)).
SPECS = {
    **unary_ops.SPECS, **binary_ops.SPECS, **activation_ops.SPECS,
    **{name: (globals()[f"_{name}"], "float") for name in ("lerp", "addcdiv")},
    **{name: (globals()[f"_{name}"], "default") for name in (
        "addcmul", "where", "clamp", "clamp_min", "clamp_max", "nan_to_num", "fill", "copy", "mse",
        "mse_backward", "dropout_backward")},
}
OPS = {name: pointwise(promote=promote)(body) for name, (body, promote) in SPECS.items()}

add, sub, mul, div, maximum, minimum, reciprocal, ne = (OPS[n] for n in (
    "add", "sub", "mul", "div", "maximum", "minimum", "reciprocal", "ne"))


def clamp(x: torch.Tensor, min=None, max=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.clamp`: bounds are numbers or tensors (broadcast), either may be None (not both)."""
    if min is None and max is None:
        raise ValueError("clamp: give min, max or both")
    if max is None:
        return OPS["clamp_min"](x, min, out=out)
    if min is None:
        return OPS["clamp_max"](x, max, out=out)
    return OPS["clamp"](x, min, max, out=out)


def where(condition: torch.Tensor, x, y) -> torch.Tensor:
    """`torch.where`: x where the condition holds, else y, in their promoted dtype."""
    tensors = [t for t in (condition, x, y) if isinstance(t, torch.Tensor)]
    out = torch.empty(torch.broadcast_shapes(*(t.shape for t in tensors)), dtype=torch.result_type(x, y)
                      if any(isinstance(t, torch.Tensor) for t in (x, y)) else _scalar_dtype(x, y),
                      device=condition.device)
    return OPS["where"](condition, x, y, out=out)


def _scalar_dtype(*values) -> torch.dtype:
    if any(isinstance(v, float) for v in values):
        return torch.get_default_dtype()
    return torch.bool if all(isinstance(v, bool) for v in values) else torch.int64


def into_self(fn, self, *args):
    """An in-place form: `fn(self, *args)` written into `self`, which must hold the promoted result as
    PyTorch requires (`int_tensor.mul_(2.5)` is refused)."""
    others = [a for a in args if isinstance(a, (torch.Tensor, bool, int, float))]
    promoted = torch.result_type(self, others[0]) if others else self.dtype
    if fn in _FLOAT_RESULTS and not promoted.is_floating_point:
        promoted = torch.get_default_dtype()
    if not torch.can_cast(promoted, self.dtype):
        raise RuntimeError(f"result type {promoted} can't be cast to the desired output type {self.dtype}")
    return fn(self, *args, out=self)


_FLOAT_RESULTS = {OPS[name] for name, (_, promote) in SPECS.items() if promote == "float"}
