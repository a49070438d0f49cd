"""The pointwise bodies of the activations that take parameters (hardtanh, leaky_relu, elu, softplus,
threshold, logit, ...) and of the activations' backwards (sigmoid's and tanh's too). `ops.pointwise_ops` makes
each body a whole op; `SPECS` gives each its name and type promotion. They compute as `ops.unary_ops`' bodies do;
silu and gelu, fused with their gates, are `ops.activations`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ops.pointwise_codegen import expression_bodies
from ops.unary_ops import _expm1, _log1p, _tanh  # noqa: F401 (the expressions below call them too)


@triton.jit
def _elu_backward(g, x, alpha, scale, input_scale):
    # x is the input (PyTorch's is_result=False form)
    return tl.where(x > 0, g * scale, g * input_scale * alpha * scale * tl.exp(x * input_scale))


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
def _logit(x, eps):
    z = tl.where(eps >= 0, tl.minimum(tl.maximum(x, eps), 1.0 - eps), x)
    return tl.log(z / (1.0 - z))


@triton.jit
def _logit_backward(g, x, eps):
    inside = (eps < 0) | ((x >= eps) & (x <= 1.0 - eps))
    return tl.where(inside, g / (x * (1.0 - x)), 0.0)


expression_bodies(globals(), {
    "_hardtanh(x, lo, hi)": "tl.where(x < lo, lo, tl.where(x > hi, hi, x))",
    "_hardtanh_backward(g, x, lo, hi)": "tl.where((x <= lo) | (x >= hi), 0.0, g)",
    "_leaky_relu(x, slope)": "tl.where(x > 0, x, x * slope)",
    "_leaky_relu_backward(g, x, slope)": "tl.where(x > 0, g, g * slope)",
    "_elu(x, alpha, scale, input_scale)": "tl.where(x > 0, x * scale, _expm1(x * input_scale) * alpha * scale)",
    "_elu_backward_result(g, y, alpha, scale, input_scale)":
        "tl.where(y > 0, g * scale, g * input_scale * (y + alpha * scale))",
    "_softplus(x, beta, threshold)": "tl.where(x * beta > threshold, x, _log1p(tl.exp(x * beta)) / beta)",
    "_hardsigmoid(x)": "tl.minimum(tl.maximum(x / 6.0 + 0.5, 0.0), 1.0)",
    "_hardsigmoid_backward(g, x)": "tl.where((x > -3.0) & (x < 3.0), g / 6.0, 0.0)",
    "_hardswish(x)": "x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0",
    "_hardswish_backward(g, x)": "tl.where(x < -3.0, 0.0, tl.where(x <= 3.0, g * (x / 3.0 + 0.5), g))",
    "_mish(x)": "x * _tanh(_softplus(x, 1.0, 20.0))",
    "_threshold(x, threshold, value)": "tl.where(x <= threshold, value, x)",
    "_threshold_backward(g, x, threshold)": "tl.where(x <= threshold, 0.0, g)",
    "_sigmoid_backward(g, y)": "g * y * (1.0 - y)",
    "_tanh_backward(g, y)": "g * (1.0 - y * y)",
})


SPECS = {
    **{name: (globals()[f"_{name}"], "float") for name in (
        "logit", "logit_backward", "hardsigmoid", "hardswish", "mish", "elu", "softplus", "log_sigmoid")},
    **{name: (globals()[f"_{name}"], "default") for name in (
        "hardtanh", "leaky_relu", "threshold", "hardtanh_backward", "leaky_relu_backward", "elu_backward",
        "elu_backward_result", "softplus_backward", "hardsigmoid_backward", "hardswish_backward", "threshold_backward",
        "sigmoid_backward", "tanh_backward", "log_sigmoid_backward")},
}
