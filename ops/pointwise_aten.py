"""The ATen overloads of the pointwise ops (`ops.aten_routes`' "pointwise" family), each our generated op of
`ops.pointwise_ops`: `ATEN` maps each overload to its function. An overload named for our op of the same name
(`exp`, `exp_`, `mul.Tensor`, `mul_.Scalar`) is that op, in place when its name ends in `_`; the others (options,
scaling, backwards) have their forms in `_FORMS`. The `.out` overloads stay PyTorch's.
"""

from __future__ import annotations

import torch

from ops.aten_routes import ROUTES
from ops.pointwise_ops import OPS, clamp, div, into_self, mul, sub, where


def _scaled(other, alpha):
    return other if alpha == 1 else mul(other, alpha)


def _not(self):
    """bitwise_not, which on bools is the logical not (the int64 it computes in would give ~1 = -2)."""
    return OPS["logical_not" if self.dtype == torch.bool else "bitwise_not"]


def _div_mode(self, other, *, rounding_mode=None, out=None):
    if rounding_mode is None:
        return div(self, other, out=out)
    if rounding_mode == "trunc" and torch.result_type(self, other) in (torch.bfloat16, torch.float16):
        # PyTorch truncates the quotient rounded to the 16-bit type (a / b in the storage type, on CPUs and CUDA)
        return OPS["trunc"](div(self, other), out=out)
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
    return OPS["where"](mask, value, self, out=out)


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



def _add_sub() -> dict:
    """add's and sub's overloads: `other` scaled by `alpha` first."""
    forms = {}
    for name in ("add", "sub"):
        fn = OPS[name]
        forms |= {
            f"{name}.Tensor": lambda self, other, *, alpha=1, fn=fn: fn(self, _scaled(other, alpha)),
            f"{name}.Scalar": lambda self, other, alpha=1, fn=fn: fn(self, _scaled(other, alpha)),
            f"{name}_.Tensor": lambda self, other, *, alpha=1, fn=fn: into_self(fn, self, _scaled(other, alpha)),
            f"{name}_.Scalar": lambda self, other, alpha=1, fn=fn: into_self(fn, self, _scaled(other, alpha)),
        }
    return forms


# The overloads whose signature is not our op's of their name.
_FORMS = {
    **_add_sub(),
    "rsub.Tensor": lambda self, other, *, alpha=1: sub(other, _scaled(self, alpha)),
    "rsub.Scalar": lambda self, other, alpha=1: sub(other, _scaled(self, alpha)),
    "sgn": lambda self: OPS["sign"](self), "sgn_": lambda self: into_self(OPS["sign"], self),
    "bitwise_not": lambda self: _not(self)(self), "bitwise_not_": lambda self: into_self(_not(self), self),
    "bitwise_left_shift.Tensor": lambda self, other: OPS["left_shift"](self, other),
    "bitwise_right_shift.Tensor": lambda self, other: OPS["right_shift"](self, other),
    "div.Tensor_mode": lambda self, other, *, rounding_mode=None: _div_mode(self, other, rounding_mode=rounding_mode),
    "div.Scalar_mode": lambda self, other, *, rounding_mode=None: _div_mode(self, other, rounding_mode=rounding_mode),
    "div_.Tensor_mode": lambda self, other, *, rounding_mode=None: _div_mode(
        self, other, rounding_mode=rounding_mode, out=self),
    "addcmul": lambda self, t1, t2, *, value=1: OPS["addcmul"](self, t1, t2, value),
    "addcmul_": lambda self, t1, t2, *, value=1: into_self(OPS["addcmul"], self, t1, t2, value),
    "addcdiv": lambda self, t1, t2, *, value=1: OPS["addcdiv"](self, t1, t2, value),
    "addcdiv_": lambda self, t1, t2, *, value=1: into_self(OPS["addcdiv"], self, t1, t2, value),
    "where.self": lambda condition, self, other: where(condition, self, other),
    "masked_fill.Scalar": _masked_fill,
    "masked_fill.Tensor": _masked_fill,
    "masked_fill_.Scalar": lambda self, mask, value: _masked_fill(self, mask, value, self),
    "masked_fill_.Tensor": lambda self, mask, value: _masked_fill(self, mask, value, self),
    "clamp": lambda self, min=None, max=None: clamp(self, min, max),
    "clamp.Tensor": lambda self, min=None, max=None: clamp(self, min, max),
    "clamp_": lambda self, min=None, max=None: clamp(self, min, max, out=self),
    "clamp_min": lambda self, min: clamp(self, min, None),
    "clamp_min.Tensor": lambda self, min: clamp(self, min, None),
    "clamp_min_": lambda self, min: clamp(self, min, None, out=self),
    "clamp_max": lambda self, max: clamp(self, None, max),
    "clamp_max.Tensor": lambda self, max: clamp(self, None, max),
    "clamp_max_": lambda self, max: clamp(self, None, max, out=self),
    "nan_to_num": _aten_nan_to_num,
    "nan_to_num_": lambda self, nan=None, posinf=None, neginf=None: _aten_nan_to_num(
        self, nan, posinf, neginf, out=self),
    "fill.Scalar": lambda self, value: _fill_(torch.empty_like(self), value),
    "fill_.Scalar": _fill_,
    "fill_.Tensor": _fill_,
    "zero_": lambda self: _fill_(self, 0),
    "hardtanh": lambda self, min_val=-1, max_val=1: OPS["hardtanh"](self, min_val, max_val),
    "hardtanh_": lambda self, min_val=-1, max_val=1: OPS["hardtanh"](self, min_val, max_val, out=self),
    "hardtanh_backward": _grad("hardtanh_backward"),
    "leaky_relu": lambda self, negative_slope=0.01: OPS["leaky_relu"](self, negative_slope),
    "leaky_relu_": lambda self, negative_slope=0.01: OPS["leaky_relu"](self, negative_slope, out=self),
    "leaky_relu_backward": _aten_leaky_relu_backward,
    "elu": lambda self, alpha=1, scale=1, input_scale=1: OPS["elu"](self, alpha, scale, input_scale),
    "elu_": lambda self, alpha=1, scale=1, input_scale=1: OPS["elu"](self, alpha, scale, input_scale, out=self),
    "elu_backward": _aten_elu_backward,
    "softplus": lambda self, beta=1, threshold=20: OPS["softplus"](self, beta, threshold),
    "softplus_backward": _grad("softplus_backward"),
    "log_sigmoid_forward": lambda self: (OPS["log_sigmoid"](self), self.new_empty(0)),
    "log_sigmoid_backward": lambda grad_output, self, buffer: OPS["log_sigmoid_backward"](
        grad_output, self).to(grad_output.dtype),
    "hardsigmoid_backward": _grad("hardsigmoid_backward"),
    "hardswish_backward": _grad("hardswish_backward"),
    "threshold": lambda self, threshold, value: OPS["threshold"](self, threshold, value),
    "threshold_": lambda self, threshold, value: OPS["threshold"](self, threshold, value, out=self),
    "threshold_backward": _grad("threshold_backward"),
    "sigmoid_backward": _grad("sigmoid_backward"),
    "tanh_backward": _grad("tanh_backward"),
    "logit": _aten_logit,
    "logit_": lambda self, eps=None: _aten_logit(self, eps, out=self),
    "logit_backward": lambda grad_output, self, eps=None: OPS["logit_backward"](
        grad_output, self, -1.0 if eps is None else eps).to(grad_output.dtype),
}


def _same_name(ours: str, aten: str):
    """Our op `ours` as the overload `aten` of its name: functional, or in place when the name ends in `_`."""
    name = aten.split(".")[0]
    if name.rstrip("_") != ours:
        raise LookupError(f"{aten}: routed as {ours}, which is not its name; give it a form in _FORMS")
    op = OPS[ours]
    if name.endswith("_"):
        return lambda self, *args: into_self(op, self, *args)
    return lambda *args: op(*args)


ATEN = {**{aten: _same_name(ours, aten) for ours, atens in ROUTES["pointwise"].items() for aten in atens
           if aten not in _FORMS}, **_FORMS}
