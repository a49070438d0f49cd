"""The pointwise ops, each one scalar `@triton.jit` body made into a whole op by the generator (`ops.pointwise`)
and one row of `SPECS`: the op's name, its body, its type promotion and the ATen overloads it routes.

A body receives its operands in the compute dtype (fp32 for fp32/fp16/bf16, fp64 for fp64, int64 for integers
and bools) and returns the value that is cast to the result dtype. Only `triton.language`'s core math is used
(no libdevice): the interpreter has no libdevice, and the same body must run there and compile for a GPU.
`OPS[name]` is the generated op (`OPS["exp"](x)`, `OPS["add"](x, y, out=x)`); `ATEN` the rows `ops.aten`
routes (functional and in-place forms; the `.out` overloads stay PyTorch's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import interpreter
from ops.pointwise import pointwise

LN2 = 0.6931471805599453
LN10 = 2.302585092994046


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


# --- activations with parameters and their backwards -------------------------------------------------------


@triton.jit
def _hardtanh(x, lo, hi):
    return tl.where(x < lo, lo, tl.where(x > hi, hi, x))


@triton.jit
def _hardtanh_backward(g, x, lo, hi):
    return tl.where((x <= lo) | (x >= hi), 0.0, g)


@triton.jit
def _leaky_relu(x, slope):
    return tl.where(x > 0, x, x * slope)


@triton.jit
def _leaky_relu_backward(g, x, slope):
    return tl.where(x > 0, g, g * slope)


@triton.jit
def _elu(x, alpha, scale, input_scale):
    return tl.where(x > 0, x * scale, _expm1(x * input_scale) * alpha * scale)


@triton.jit
def _elu_backward(g, x, alpha, scale, input_scale):
    # x is the input (PyTorch's is_result=False form)
    return tl.where(x > 0, g * scale, g * input_scale * alpha * scale * tl.exp(x * input_scale))


@triton.jit
def _elu_backward_result(g, y, alpha, scale, input_scale):
    return tl.where(y > 0, g * scale, g * input_scale * (y + alpha * scale))


@triton.jit
def _softplus(x, beta, threshold):
    return tl.where(x * beta > threshold, x, _log1p(tl.exp(x * beta)) / beta)


@triton.jit
def _softplus_backward(g, x, beta, threshold):
    z = tl.exp(x * beta)
    return tl.where(x * beta > threshold, g, g * z / (z + 1.0))


@triton.jit
def _log_sigmoid(x):
    # min(x, 0) - log(1 + e^-|x|): no overflow either side.
    return tl.minimum(x, 0.0) - _log1p(tl.exp(-tl.abs(x)))


@triton.jit
def _log_sigmoid_backward(g, x):
    # g * sigmoid(-x), from e^-|x|.
    e = tl.exp(-tl.abs(x))
    return g * tl.where(x < 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _hardsigmoid(x):
    return tl.minimum(tl.maximum(x / 6.0 + 0.5, 0.0), 1.0)


@triton.jit
def _hardsigmoid_backward(g, x):
    return tl.where((x > -3.0) & (x < 3.0), g / 6.0, 0.0)


@triton.jit
def _hardswish(x):
    return x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0


@triton.jit
def _hardswish_backward(g, x):
    return tl.where(x < -3.0, 0.0, tl.where(x <= 3.0, g * (x / 3.0 + 0.5), g))


@triton.jit
def _mish(x):
    return x * _tanh(_softplus(x, 1.0, 20.0))


@triton.jit
def _threshold(x, threshold, value):
    return tl.where(x <= threshold, value, x)


@triton.jit
def _threshold_backward(g, x, threshold):
    return tl.where(x <= threshold, 0.0, g)


@triton.jit
def _sigmoid_backward(g, y):
    return g * y * (1.0 - y)


@triton.jit
def _tanh_backward(g, y):
    return g * (1.0 - y * y)


@triton.jit
def _logit(x, eps):
    z = tl.where(eps >= 0, tl.minimum(tl.maximum(x, eps), 1.0 - eps), x)
    return tl.log(z / (1.0 - z))


@triton.jit
def _logit_backward(g, x, eps):
    inside = (eps < 0) | ((x >= eps) & (x <= 1.0 - eps))
    return tl.where(inside, g / (x * (1.0 - x)), 0.0)


# --- binary ------------------------------------------------------------------------------------------------


@triton.jit
def _add(x, y):
    return x + y


@triton.jit
def _sub(x, y):
    return x - y


@triton.jit
def _mul(x, y):
    return x * y


@triton.jit
def _div(x, y):
    return x / y


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
def _maximum(x, y):
    return tl.where((x != x) | (x > y), x, y)


@triton.jit
def _minimum(x, y):
    return tl.where((x != x) | (x < y), x, y)


@triton.jit
def _fmax(x, y):
    return tl.where((y != y) | (x > y), x, y)


@triton.jit
def _fmin(x, y):
    return tl.where((y != y) | (x < y), x, y)


@triton.jit
def _bitwise_and(x, y):
    return x & y


@triton.jit
def _bitwise_or(x, y):
    return x | y


@triton.jit
def _bitwise_xor(x, y):
    return x ^ y


@triton.jit
def _left_shift(x, y):
    return x << y


@triton.jit
def _right_shift(x, y):
    return x >> y


@triton.jit
def _copysign(x, y):
    a = tl.abs(x)
    return tl.where(_signbit(y), -a, a)


@triton.jit
def _hypot(x, y):
    return tl.sqrt(x * x + y * y)


@triton.jit
def _xlogy(x, y):
    return tl.where(y != y, y, tl.where(x == 0, 0.0, x * tl.log(y)))


@triton.jit
def _logaddexp(x, y):
    m = tl.maximum(x, y)
    return tl.where(tl.abs(m) == float("inf"), m, m + _log1p(tl.exp(-tl.abs(x - y))))


@triton.jit
def _logaddexp2(x, y):
    m = tl.maximum(x, y)
    return tl.where(tl.abs(m) == float("inf"), m, m + _log1p(tl.exp2(-tl.abs(x - y))) / 0.6931471805599453)


@triton.jit
def _heaviside(x, y):
    return tl.where(x == 0, y, tl.where(x > 0, 1, 0).to(x.dtype))


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


@triton.jit
def _eq(x, y):
    return x == y


@triton.jit
def _ne(x, y):
    return x != y


@triton.jit
def _lt(x, y):
    return x < y


@triton.jit
def _le(x, y):
    return x <= y


@triton.jit
def _gt(x, y):
    return x > y


@triton.jit
def _ge(x, y):
    return x >= y


@triton.jit
def _logical_and(x, y):
    return (x != 0) & (y != 0)


@triton.jit
def _logical_or(x, y):
    return (x != 0) | (y != 0)


@triton.jit
def _logical_xor(x, y):
    return (x != 0) != (y != 0)


# --- ternary and the rest ----------------------------------------------------------------------------------


@triton.jit
def _lerp(x, y, w):
    # PyTorch's two-sided form: exact at both ends.
    return tl.where(tl.abs(w) < 0.5, x + w * (y - x), y - (y - x) * (1.0 - w))


@triton.jit
def _addcmul(x, a, b, value):
    return x + value * a * b


@triton.jit
def _addcdiv(x, a, b, value):
    return x + value * a / b


@triton.jit
def _where(c, x, y):
    return tl.where(c != 0, x, y)


@triton.jit
def _clamp(x, lo, hi):
    # torch.clamp's order (min first, then max: hi wins when lo > hi); a NaN stays NaN.
    y = tl.where(x < lo, lo, x)
    return tl.where(y > hi, hi, y)


@triton.jit
def _clamp_min(x, lo):
    return tl.where(x < lo, lo, x)


@triton.jit
def _clamp_max(x, hi):
    return tl.where(x > hi, hi, x)


@triton.jit
def _nan_to_num(x, nan, posinf, neginf):
    r = tl.where(x != x, nan, x)
    return tl.where(x == float("inf"), posinf, tl.where(x == float("-inf"), neginf, r))


@triton.jit
def _fill(x, value):
    return tl.zeros_like(x) + value


@triton.jit
def _copy(x):
    return x


@triton.jit
def _mse(x, y):
    d = x - y
    return d * d


@triton.jit
def _mse_backward(g, x, y, scale):
    return 2.0 * scale * (x - y) * g


@triton.jit
def _dropout_backward(g, mask, scale):
    return g * mask * scale


# name: (body, promotion: "default" (the operands' dtype), "float" (integers to float) or "bool" (a test)).
SPECS = {
    **{name: (globals()[f"_{name}"], "float") for name in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "sinh",
        "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc", "reciprocal", "deg2rad", "rad2deg",
        "sinc", "div", "copysign", "hypot", "xlogy", "logaddexp", "logaddexp2", "lerp", "addcdiv", "logit",
        "logit_backward", "hardsigmoid", "hardswish", "mish", "elu", "softplus", "log_sigmoid")},
    **{name: (globals()[f"_{name}"], "default") for name in (
        "abs", "neg", "sign", "floor", "ceil", "trunc", "round", "frac", "relu", "bitwise_not", "hardtanh",
        "leaky_relu", "threshold", "add", "sub", "mul", "div_trunc", "floor_divide", "remainder", "fmod",
        "maximum", "minimum", "fmax", "fmin", "bitwise_and", "bitwise_or", "bitwise_xor", "heaviside", "pow",
        "addcmul", "clamp", "clamp_min", "clamp_max", "nan_to_num", "fill", "copy", "mse", "hardtanh_backward",
        "leaky_relu_backward", "elu_backward", "elu_backward_result", "softplus_backward",
        "hardsigmoid_backward", "hardswish_backward", "threshold_backward", "sigmoid_backward", "tanh_backward",
        "mse_backward", "dropout_backward", "left_shift", "right_shift", "log_sigmoid_backward")},
    **{name: (globals()[f"_{name}"], "bool") for name in (
        "logical_not", "isnan", "isinf", "isposinf", "isneginf", "signbit", "eq", "ne", "lt", "le", "gt", "ge",
        "logical_and", "logical_or", "logical_xor")},
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
    return _WHERE(condition, x, y, out=out)


def _scalar_dtype(*values) -> torch.dtype:
    if any(isinstance(v, float) for v in values):
        return torch.get_default_dtype()
    return torch.bool if all(isinstance(v, bool) for v in values) else torch.int64


_WHERE = pointwise()(_where)


# --- the ATen rows -----------------------------------------------------------------------------------------


def _into_self(fn, self, *args):
    """An in-place form: `fn(self, *args)` written into `self`, which must hold the promoted result as
    PyTorch requires (`int_tensor.mul_(2.5)` is refused)."""
    others = [a for a in args if isinstance(a, (torch.Tensor, bool, int, float))]
    promoted = torch.result_type(self, others[0]) if others else self.dtype
    if fn in _FLOAT_RESULTS and not promoted.is_floating_point:
        promoted = torch.get_default_dtype()
    if not torch.can_cast(promoted, self.dtype):
        raise RuntimeError(f"result type {promoted} can't be cast to the desired output type {self.dtype}")
    return fn(self, *args, out=self)


def _scaled(other, alpha):
    return other if alpha == 1 else mul(other, alpha)


def _unary(name):
    return lambda self: OPS[name](self)


def _unary_(name):
    return lambda self: _into_self(OPS[name], self)


def _binary(name):
    return lambda self, other: OPS[name](self, other)


def _binary_(name):
    return lambda self, other: _into_self(OPS[name], self, other)


def _div_mode(self, other, *, rounding_mode=None, out=None):
    if rounding_mode is None:
        return div(self, other, out=out)
    return OPS["div_trunc" if rounding_mode == "trunc" else "floor_divide"](self, other, out=out)


def _finite(dtype: torch.dtype, nan, posinf, neginf):
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return (0.0 if nan is None else nan, info.max if posinf is None else posinf,
            info.min if neginf is None else neginf)


def _aten_nan_to_num(self, nan=None, posinf=None, neginf=None, out=None):
    if not self.is_floating_point():
        return self.clone() if out is None else out.copy_(self)
    return OPS["nan_to_num"](self, *_finite(self.dtype, nan, posinf, neginf), out=out)


def _masked_fill(self, mask, value, out=None):
    out = torch.empty(torch.broadcast_shapes(self.shape, mask.shape), dtype=self.dtype,
                      device=self.device) if out is None else out
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    return _WHERE(mask, value, self, out=out)


def _fill_(self, value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    return OPS["fill"](self, value, out=self)


def _aten_elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    body = OPS["elu_backward_result" if is_result else "elu_backward"]
    return body(grad_output, self_or_result, alpha, scale, input_scale).to(grad_output.dtype)


def _aten_leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    return OPS["leaky_relu_backward"](grad_output, self, negative_slope).to(grad_output.dtype)


def _aten_logit(self, eps=None, out=None):
    return OPS["logit"](self, -1.0 if eps is None else eps, out=out)


def _grad(name):
    """A backward formula: the gradient in grad_output's dtype."""
    return lambda grad_output, *args: OPS[name](grad_output, *args).to(grad_output.dtype)


def _same_device_real(*tensors) -> bool:
    return all(not t.is_complex() and t.layout == torch.strided for t in tensors) and len(
        {t.device for t in tensors}) == 1


_EXPLICIT = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _copy_(self, src, non_blocking=False):
    """`Tensor.copy_`: ours on one device between real dtypes; across devices PyTorch's own."""
    if not _same_device_real(self, src) or interpreter.launching():
        return torch.ops.aten.copy_.default.redispatch(_EXPLICIT, self, src, non_blocking)
    if src.dtype != self.dtype and src.is_complex():
        raise RuntimeError("copy_: a complex source into a real tensor drops the imaginary part")
    return OPS["copy"](src.expand(self.shape), out=self) if self.numel() else self


def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    """`Tensor.to` (a cast or a copy): ours on the same device; a transfer is PyTorch's own."""
    same = device is None or torch.device(device) == self.device
    if not same or pin_memory or (layout not in (None, torch.strided)) or self.is_complex() or (
            dtype is not None and dtype.is_complex):
        return torch.ops.aten._to_copy.default.redispatch(
            _EXPLICIT, self, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
            non_blocking=non_blocking, memory_format=memory_format)
    out = torch.empty_like(self, dtype=dtype or self.dtype, memory_format=memory_format or torch.preserve_format)
    return OPS["copy"](self, out=out) if out.numel() else out


def _clone(self, *, memory_format=None):
    return _to_copy(self, memory_format=memory_format)


def _rows() -> list[tuple[str, str, object]]:
    rows = []
    unary = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "sinh",
             "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc", "reciprocal", "deg2rad",
             "rad2deg", "sinc", "abs", "neg", "sign", "floor", "ceil", "trunc", "round", "frac", "relu",
             "bitwise_not", "logical_not", "isnan", "isinf", "isposinf", "isneginf", "signbit", "hardsigmoid",
             "hardswish", "mish")
    for name in unary:
        if name == "bitwise_not":  # on bools the logical not (the int64 it computes in would give ~1 = -2)
            rows += [(name, name, lambda self: OPS["logical_not" if self.dtype == torch.bool else "bitwise_not"](
                self)), (name, f"{name}_", lambda self: _into_self(
                    OPS["logical_not" if self.dtype == torch.bool else "bitwise_not"], self))]
            continue
        rows.append((name, name, _unary(name)))
        if name not in ("isnan", "isinf", "isposinf", "isneginf", "signbit"):
            rows.append((name, f"{name}_", _unary_(name)))
    rows += [("sgn", "sgn", _unary("sign")), ("sgn", "sgn_", _unary_("sign"))]
    for name in ("add", "sub"):
        fn = OPS[name]
        rows += [(name, f"{name}.Tensor", lambda self, other, *, alpha=1, fn=fn: fn(self, _scaled(other, alpha))),
                 (name, f"{name}.Scalar", lambda self, other, alpha=1, fn=fn: fn(self, _scaled(other, alpha))),
                 (name, f"{name}_.Tensor",
                  lambda self, other, *, alpha=1, fn=fn: _into_self(fn, self, _scaled(other, alpha))),
                 (name, f"{name}_.Scalar",
                  lambda self, other, alpha=1, fn=fn: _into_self(fn, self, _scaled(other, alpha)))]
    rows += [("rsub", "rsub.Tensor", lambda self, other, *, alpha=1: sub(other, _scaled(self, alpha))),
             ("rsub", "rsub.Scalar", lambda self, other, alpha=1: sub(other, _scaled(self, alpha)))]
    for name, aten in (("mul", "mul"), ("div", "div"), ("remainder", "remainder"), ("fmod", "fmod"),
                       ("bitwise_and", "bitwise_and"), ("bitwise_or", "bitwise_or"), ("bitwise_xor", "bitwise_xor"),
                       ("eq", "eq"), ("ne", "ne"), ("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge")):
        for overload in ("Tensor", "Scalar"):
            rows += [(aten, f"{aten}.{overload}", _binary(name)), (aten, f"{aten}_.{overload}", _binary_(name))]
    rows += [("div", "div.Tensor_mode", lambda self, other, *, rounding_mode=None: _div_mode(self, other,
                                                                                            rounding_mode=rounding_mode)),
             ("div", "div.Scalar_mode", lambda self, other, *, rounding_mode=None: _div_mode(self, other,
                                                                                            rounding_mode=rounding_mode)),
             ("div", "div_.Tensor_mode", lambda self, other, *, rounding_mode=None: _div_mode(
                 self, other, rounding_mode=rounding_mode, out=self)),
             ("floor_divide", "floor_divide", _binary("floor_divide")),
             ("floor_divide", "floor_divide.Scalar", _binary("floor_divide")),
             ("floor_divide", "floor_divide_.Tensor", _binary_("floor_divide"))]
    for name in ("maximum", "minimum", "fmax", "fmin", "hypot", "logaddexp", "logaddexp2", "heaviside",
                 "logical_and", "logical_or", "logical_xor"):
        rows.append((name, name, _binary(name)))
        if name in ("hypot", "heaviside", "logical_and", "logical_or", "logical_xor"):
            rows.append((name, f"{name}_", _binary_(name)))
    rows += [("copysign", "copysign.Tensor", _binary("copysign")), ("copysign", "copysign.Scalar", _binary("copysign")),
             ("copysign", "copysign_.Tensor", _binary_("copysign")), ("xlogy", "xlogy_.Tensor", _binary_("xlogy")),
             ("xlogy", "xlogy.Tensor", _binary("xlogy")), ("xlogy", "xlogy.Scalar_Other", _binary("xlogy")),
             ("bitwise_left_shift", "bitwise_left_shift.Tensor", _binary("left_shift")),
             ("bitwise_right_shift", "bitwise_right_shift.Tensor", _binary("right_shift")),
             ("pow", "pow.Tensor_Tensor", _binary("pow")), ("pow", "pow.Tensor_Scalar", _binary("pow")),
             ("pow", "pow.Scalar", _binary("pow")), ("pow", "pow_.Scalar", _binary_("pow")),
             ("pow", "pow_.Tensor", _binary_("pow"))]
    return rows + _rows_with_options()


def _rows_with_options() -> list[tuple[str, str, object]]:
    op = OPS
    return [
        ("lerp", "lerp.Scalar", lambda self, end, weight: op["lerp"](self, end, weight)),
        ("lerp", "lerp.Tensor", lambda self, end, weight: op["lerp"](self, end, weight)),
        ("lerp", "lerp_.Scalar", lambda self, end, weight: _into_self(op["lerp"], self, end, weight)),
        ("lerp", "lerp_.Tensor", lambda self, end, weight: _into_self(op["lerp"], self, end, weight)),
        ("addcmul", "addcmul", lambda self, t1, t2, *, value=1: op["addcmul"](self, t1, t2, value)),
        ("addcmul", "addcmul_", lambda self, t1, t2, *, value=1: _into_self(op["addcmul"], self, t1, t2, value)),
        ("addcdiv", "addcdiv", lambda self, t1, t2, *, value=1: op["addcdiv"](self, t1, t2, value)),
        ("addcdiv", "addcdiv_", lambda self, t1, t2, *, value=1: _into_self(op["addcdiv"], self, t1, t2, value)),
        ("where", "where.self", lambda condition, self, other: where(condition, self, other)),
        ("masked_fill", "masked_fill.Scalar", _masked_fill), ("masked_fill", "masked_fill.Tensor", _masked_fill),
        ("masked_fill", "masked_fill_.Scalar", lambda self, mask, value: _masked_fill(self, mask, value, self)),
        ("masked_fill", "masked_fill_.Tensor", lambda self, mask, value: _masked_fill(self, mask, value, self)),
        ("clamp", "clamp", lambda self, min=None, max=None: clamp(self, min, max)),
        ("clamp", "clamp.Tensor", lambda self, min=None, max=None: clamp(self, min, max)),
        ("clamp", "clamp_", lambda self, min=None, max=None: clamp(self, min, max, out=self)),
        ("clamp_min", "clamp_min", lambda self, min: clamp(self, min, None)),
        ("clamp_min", "clamp_min.Tensor", lambda self, min: clamp(self, min, None)),
        ("clamp_min", "clamp_min_", lambda self, min: clamp(self, min, None, out=self)),
        ("clamp_max", "clamp_max", lambda self, max: clamp(self, None, max)),
        ("clamp_max", "clamp_max.Tensor", lambda self, max: clamp(self, None, max)),
        ("clamp_max", "clamp_max_", lambda self, max: clamp(self, None, max, out=self)),
        ("nan_to_num", "nan_to_num", _aten_nan_to_num),
        ("nan_to_num", "nan_to_num_", lambda self, nan=None, posinf=None, neginf=None: _aten_nan_to_num(
            self, nan, posinf, neginf, out=self)),
        ("fill", "fill.Scalar", lambda self, value: _fill_(torch.empty_like(self), value)),
        ("fill", "fill_.Scalar", _fill_), ("fill", "fill_.Tensor", _fill_),
        ("zero_", "zero_", lambda self: _fill_(self, 0)),
        ("copy_", "copy_", _copy_), ("_to_copy", "_to_copy", _to_copy), ("clone", "clone", _clone),
        *_activation_rows(),
    ]


def _activation_rows() -> list[tuple[str, str, object]]:
    """The activations' rows with options (slopes, thresholds), their in-place forms and their backwards."""
    op = OPS
    return [
        ("hardtanh", "hardtanh", lambda self, min_val=-1, max_val=1: op["hardtanh"](self, min_val, max_val)),
        ("hardtanh", "hardtanh_", lambda self, min_val=-1, max_val=1: op["hardtanh"](self, min_val, max_val,
                                                                                    out=self)),
        ("hardtanh", "hardtanh_backward", _grad("hardtanh_backward")),
        ("leaky_relu", "leaky_relu", lambda self, negative_slope=0.01: op["leaky_relu"](self, negative_slope)),
        ("leaky_relu", "leaky_relu_", lambda self, negative_slope=0.01: op["leaky_relu"](self, negative_slope,
                                                                                        out=self)),
        ("leaky_relu", "leaky_relu_backward", _aten_leaky_relu_backward),
        ("elu", "elu", lambda self, alpha=1, scale=1, input_scale=1: op["elu"](self, alpha, scale, input_scale)),
        ("elu", "elu_", lambda self, alpha=1, scale=1, input_scale=1: op["elu"](self, alpha, scale, input_scale,
                                                                               out=self)),
        ("elu", "elu_backward", _aten_elu_backward),
        ("softplus", "softplus", lambda self, beta=1, threshold=20: op["softplus"](self, beta, threshold)),
        ("softplus", "softplus_backward", _grad("softplus_backward")),
        # The buffer PyTorch's CPU forward returns is its own backward's; ours recomputes from the input.
        ("log_sigmoid", "log_sigmoid_forward", lambda self: (op["log_sigmoid"](self), self.new_empty(0))),
        ("log_sigmoid", "log_sigmoid_backward", lambda grad_output, self, buffer: op["log_sigmoid_backward"](
            grad_output, self).to(grad_output.dtype)),
        ("hardsigmoid", "hardsigmoid_backward", _grad("hardsigmoid_backward")),
        ("hardswish", "hardswish_backward", _grad("hardswish_backward")),
        ("threshold", "threshold", lambda self, threshold, value: op["threshold"](self, threshold, value)),
        ("threshold", "threshold_", lambda self, threshold, value: op["threshold"](self, threshold, value,
                                                                                  out=self)),
        ("threshold", "threshold_backward", _grad("threshold_backward")),
        ("sigmoid", "sigmoid_backward", _grad("sigmoid_backward")),
        ("tanh", "tanh_backward", _grad("tanh_backward")),
        ("logit", "logit", _aten_logit), ("logit", "logit_", lambda self, eps=None: _aten_logit(self, eps, out=self)),
        ("logit", "logit_backward", lambda grad_output, self, eps=None: op["logit_backward"](
            grad_output, self, -1.0 if eps is None else eps).to(grad_output.dtype)),
    ]


_FLOAT_RESULTS = {OPS[name] for name, (_, promote) in SPECS.items() if promote == "float"}
ATEN = _rows()
