"""The op tests of the ATen table (`python -m ops list`): each routed op, called through PyTorch's own API under
`ops.use_kernels(include=[op])`, against the same call in PyTorch, on the layouts that break kernels (empty,
0-dim, 1-element, odd-sized, transposed, expanded/broadcast) in fp32/bf16/fp16 (and int/bool where the op
takes them), with FlagGems' tolerances by dtype; the op's counter must grow (the call reached ours), and where
the op has a backward the input gradients are checked against autograd's."""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch

import ops
from ops.aten import calls
from tests.ops.conftest import DEVICE
from tests.ops.families.common import _tolerance

LAYOUTS = ["empty", "scalar", "one", "odd", "transposed", "expanded"]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
FLOAT_IDS = ["fp32", "bf16", "fp16"]


def make(layout: str, dtype: torch.dtype, positive: bool = False, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = {"empty": (0, 3), "scalar": (), "one": (1,), "odd": (3, 5), "transposed": (5, 3), "expanded": (1, 5)}
    if dtype.is_floating_point:
        x = torch.randn(shape[layout], generator=g, dtype=torch.float64) * 2
        x = x.abs() + 0.1 if positive else x
    elif dtype == torch.bool:
        x = torch.randint(0, 2, shape[layout], generator=g).bool()
    else:
        x = torch.randint(1 if positive else -9, 9, shape[layout], generator=g)
    x = x.to(device=DEVICE, dtype=dtype)
    if layout == "transposed":
        x = x.t()
    if layout == "expanded":
        x = x.expand(3, 5)
    return x


def routed(name, fn, *args):
    """fn(*args) with `name` (or each of a list) routed; asserts that the call reached our kernel."""
    before = sum(calls.values())
    with ops.use_kernels(include=[name] if isinstance(name, str) else list(name)):
        out = fn(*args)
    assert sum(calls.values()) > before, f"{name}: the call did not reach our kernel"
    return out


def close(got, expected, dtype, reduced=1):
    if isinstance(expected, (tuple, list)):
        for g, e in zip(got, expected, strict=True):
            close(g, e, dtype, reduced)
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, expected.dtype, got.shape)
    if not expected.is_floating_point():
        assert torch.equal(got, expected)
        return
    atol, rtol = _tolerance(dtype if dtype in FLOATS else torch.float32, reduced)
    torch.testing.assert_close(got.double(), expected.double(), atol=atol, rtol=rtol, equal_nan=True)


UNARY = ["exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "sinh",
         "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc", "reciprocal", "deg2rad", "rad2deg",
         "sinc", "abs", "neg", "sign", "sgn", "floor", "ceil", "trunc", "round", "frac", "relu", "isnan", "isinf",
         "isposinf", "isneginf", "signbit", "logical_not"]
POSITIVE = {"log", "log2", "log10", "sqrt", "rsqrt", "acosh", "log1p"}
INTEGER_UNARY = {"abs", "neg", "sign", "relu", "logical_not", "bitwise_not", "isnan", "floor", "ceil", "trunc", "round"}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [*FLOATS, torch.int32], ids=[*FLOAT_IDS, "int32"])
@pytest.mark.parametrize("name", UNARY)
def test_unary_ops_match_torch(name, dtype, layout):
    if not dtype.is_floating_point and name not in INTEGER_UNARY:
        pytest.skip("a float op")
    x = make(layout, dtype, positive=name in POSITIVE)
    if name == "acosh" and dtype.is_floating_point:
        x = x + 1
    fn = getattr(torch, name)
    close(routed(name, fn, x), fn(x), dtype)


BINARY = ["add", "sub", "mul", "div", "remainder", "fmod", "floor_divide", "maximum", "minimum", "fmax", "fmin",
          "pow", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "hypot", "copysign",
          "xlogy", "logaddexp", "logaddexp2", "heaviside", "bitwise_and", "bitwise_or", "bitwise_xor", "rsub"]
SCALARS = {"add", "sub", "mul", "div", "remainder", "fmod", "floor_divide", "pow", "eq", "ne", "lt", "le", "gt", "ge",
           "bitwise_and", "bitwise_or", "bitwise_xor", "rsub", "copysign", "xlogy"}
INTEGER_BINARY = {"add", "sub", "mul", "remainder", "fmod", "floor_divide", "maximum", "minimum", "eq", "ne", "lt",
                  "le", "gt", "ge", "logical_and", "bitwise_and", "bitwise_or", "bitwise_xor", "rsub"}


@pytest.mark.parametrize("form", ["broadcast", "scalar", "inplace", "transposed"])
@pytest.mark.parametrize("dtype", [*FLOATS, torch.int32], ids=[*FLOAT_IDS, "int32"])
@pytest.mark.parametrize("name", BINARY)
def test_binary_ops_match_torch(name, dtype, form):
    if not dtype.is_floating_point and name not in INTEGER_BINARY:
        pytest.skip("a float op")
    if dtype.is_floating_point and name.startswith("bitwise"):
        pytest.skip("an integer op")
    divides = name in ("div", "remainder", "fmod", "floor_divide")
    x, y = make("odd", dtype, seed=1), make("odd", dtype, positive=divides or name == "pow", seed=2)[0]
    if name == "pow":
        x = x.abs() + (1 if not dtype.is_floating_point else 0.1)
    if form == "scalar":  # a Python number where the op takes one, else a 0-dim tensor
        y = y[0].item() if name in SCALARS else y[0].clone()
    if form == "transposed":
        x, y = make("transposed", dtype, seed=1), make("transposed", dtype, positive=divides, seed=2)
        if name == "pow":
            x, y = x.abs() + 1, y.abs() % 3
    fn = getattr(torch, name)
    if form == "inplace" and hasattr(torch.Tensor, f"{name}_"):
        expected = getattr(x.clone(), f"{name}_")(y)
        got = x.clone()
        routed(name, lambda a, b: getattr(a, f"{name}_")(b), got, y)
        close(got, expected, dtype)
        return
    close(routed(name, fn, x, y), fn(x, y), dtype)


CALLS = {  # op: (the call, its inputs from (dtype) -> list, whether it has a backward to check)
    "where": (lambda c, x, y: torch.where(c, x, y), lambda d: [make("odd", d) > 0, make("odd", d, seed=1),
                                                               make("expanded", d, seed=2)], True),
    "masked_fill": (lambda x, m: x.masked_fill(m, -1.5), lambda d: [make("transposed", d), make("odd", d) > 0], True),
    "clamp": (lambda x: x.clamp(-0.5, 0.7), lambda d: [make("transposed", d)], True),
    "clamp_min": (lambda x: x.clamp_min(0.2), lambda d: [make("odd", d)], True),
    "clamp_max": (lambda x: x.clamp_max(0.2), lambda d: [make("odd", d)], True),
    "lerp": (lambda x, y: torch.lerp(x, y, 0.3), lambda d: [make("odd", d), make("expanded", d, seed=1)], True),
    "addcmul": (lambda x, a, b: torch.addcmul(x, a, b, value=0.5), lambda d: [make("odd", d, seed=s)
                                                                              for s in range(3)], True),
    "addcdiv": (lambda x, a, b: torch.addcdiv(x, a, b, value=0.5), lambda d: [
        make("odd", d), make("odd", d, seed=1), make("odd", d, positive=True, seed=2)], True),
    "nan_to_num": (lambda x: torch.nan_to_num(x.log()), lambda d: [make("odd", d)], False),
    "hardtanh": (lambda x: torch.nn.functional.hardtanh(x, -0.5, 0.5), lambda d: [make("odd", d)], True),
    "leaky_relu": (lambda x: torch.nn.functional.leaky_relu(x, 0.1), lambda d: [make("odd", d)], True),
    "elu": (torch.nn.functional.elu, lambda d: [make("odd", d)], True),
    "softplus": (torch.nn.functional.softplus, lambda d: [make("odd", d)], True),
    "hardsigmoid": (torch.nn.functional.hardsigmoid, lambda d: [make("odd", d)], True),
    "hardswish": (torch.nn.functional.hardswish, lambda d: [make("odd", d)], True),
    "threshold": (lambda x: torch.nn.functional.threshold(x, 0.1, -2.0), lambda d: [make("odd", d)], True),
    "logit": (lambda x: torch.logit(x, 1e-3), lambda d: [make("odd", d).sigmoid()], True),
    "tanh": (torch.tanh, lambda d: [make("transposed", d)], True),
    "sigmoid": (torch.sigmoid, lambda d: [make("transposed", d)], True),
    "_to_copy": (lambda x: x.to(torch.float64), lambda d: [make("transposed", d)], False),
    "clone": (lambda x: x.clone(), lambda d: [make("transposed", d)], False),
    "copy_": (lambda x, y: x.clone().copy_(y), lambda d: [make("odd", d), make("expanded", d)], False),
    "fill": (lambda x: x.clone().fill_(2.5), lambda d: [make("transposed", d)], False),
    "sum": (lambda x: (x.sum(), x.sum(1), x.sum([0, 1], keepdim=True)), lambda d: [make("transposed", d)], True),
    "mean": (lambda x: (x.mean(), x.mean(0, keepdim=True)), lambda d: [make("transposed", d)], True),
    "amax": (lambda x: (x.amax(1), x.amax([0, 1])), lambda d: [make("odd", d)], True),
    "amin": (lambda x: (x.amin(0), x.amin()), lambda d: [make("transposed", d)], True),
    "max": (lambda x: (x.max(), *x.max(1)), lambda d: [make("odd", d)], False),
    "min": (lambda x: (x.min(), *x.min(0)), lambda d: [make("transposed", d)], False),
    "argmax": (lambda x: (x.argmax(), x.argmax(1, keepdim=True)), lambda d: [make("odd", d)], False),
    "argmin": (lambda x: (x.argmin(), x.argmin(0)), lambda d: [make("transposed", d)], False),
    "prod": (lambda x: (x.prod(), x.prod(1)), lambda d: [make("odd", d)], True),
    "var": (lambda x: (x.var(), x.var(1, correction=0)), lambda d: [make("transposed", d)], True),
    "std": (lambda x: (x.std(0), x.std(keepdim=True)), lambda d: [make("odd", d)], True),
    "all": (lambda x: (x.all(), x.all(1)), lambda d: [make("odd", d) > -1], False),
    "any": (lambda x: (x.any(), x.any(0)), lambda d: [make("odd", d) > 1], False),
    "logsumexp": (lambda x: torch.logsumexp(x, 1), lambda d: [make("transposed", d)], True),
    "linalg_vector_norm": (lambda x: (torch.linalg.vector_norm(x), torch.linalg.vector_norm(x, 1, 1),
                                      torch.linalg.vector_norm(x, float("inf"))), lambda d: [make("odd", d)], True),
    "cumsum": (lambda x: (x.cumsum(0), x.cumsum(1)), lambda d: [make("transposed", d)], True),
    "cumprod": (lambda x: x.cumprod(1), lambda d: [make("odd", d)], False),
    "cummax": (lambda x: (*x.cummax(0), *x.cummax(1)), lambda d: [make("transposed", d)], True),
    "cummin": (lambda x: x.cummin(1), lambda d: [make("odd", d)], True),
    "index_select": (lambda x, i: x.index_select(1, i), lambda d: [make("transposed", d),
                                                                  torch.tensor([2, 0, 2], device=DEVICE)], True),
    "gather": (lambda x, i: x.gather(1, i), lambda d: [make("odd", d), torch.tensor(
        [[0, 4], [1, 1], [3, 2]], device=DEVICE)], True),
    "scatter_add": (lambda x, i, s: x.scatter_add(1, i, s), lambda d: [
        make("odd", d), torch.tensor([[0, 4], [1, 1], [3, 2]], device=DEVICE), make("odd", d, seed=1)[:, :2]], False),
    "scatter": (lambda x, i, s: x.scatter(1, i, s), lambda d: [
        make("odd", d), torch.tensor([[0, 4], [1, 2], [3, 2]], device=DEVICE), make("odd", d, seed=1)[:, :2]], False),
    "index_add": (lambda x, i, s: x.index_add(0, i, s), lambda d: [
        make("odd", d), torch.tensor([2, 0, 2], device=DEVICE), make("odd", d, seed=1)], False),
    "index_put": (lambda x, i, v: x.index_put((i,), v, accumulate=True), lambda d: [
        make("odd", d), torch.tensor([2, 0, 2], device=DEVICE), make("odd", d, seed=1)], False),
    "masked_select": (lambda x, m: x.masked_select(m), lambda d: [make("transposed", d), make("odd", d) > 0], False),
    "nonzero": (lambda x: x.nonzero(), lambda d: [make("transposed", d) > 0], False),
    "cat": (lambda x, y: torch.cat([x, y, x[:0]], 0), lambda d: [make("transposed", d), make("odd", d)], True),
    "flip": (lambda x: x.flip(0, 1), lambda d: [make("transposed", d)], False),
    "repeat": (lambda x: x.repeat(2, 1, 3), lambda d: [make("transposed", d)], False),
    "tril": (lambda x: (x.tril(), x.tril(-1)), lambda d: [make("transposed", d)], False),
    "triu": (lambda x: (x.triu(), x.triu(2)), lambda d: [make("odd", d)], False),
    "native_layer_norm": (lambda x, w, b: torch.nn.functional.layer_norm(x, (5,), w, b), lambda d: [
        make("odd", d), make("odd", d, seed=1)[0], make("odd", d, seed=2)[0]], True),
    "mse_loss": (torch.nn.functional.mse_loss, lambda d: [make("odd", d), make("transposed", d)], True),
    "nll_loss": (lambda x, t: torch.nn.functional.nll_loss(x.log_softmax(-1), t, ignore_index=1),
                 lambda d: [make("odd", d), torch.tensor([0, 1, 4], device=DEVICE)], True),
    "baddbmm": (lambda s, a, b: torch.baddbmm(s, a, b, beta=0.5, alpha=2), lambda d: [
        make("odd", d), torch.randn(2, 3, 4, device=DEVICE, dtype=d), torch.randn(2, 5, 4, device=DEVICE,
                                                                                   dtype=d).transpose(1, 2)], False),
    "mv": (torch.mv, lambda d: [make("odd", d), make("odd", d, seed=1)[0]], False),
    "native_group_norm": (lambda x, w, b: (torch.nn.functional.group_norm(x, 3, w, b),
                                           torch.nn.functional.group_norm(x.transpose(1, 2)[:, :4], 2)),
                          lambda d: [torch.randn(2, 6, 5, device=DEVICE, dtype=d),
                                     make("odd", d, seed=1).reshape(-1)[:6], make("odd", d, seed=2).reshape(-1)[:6]],
                          True),
    "sort": (lambda x: (*x.sort(dim=1, descending=True, stable=True), *x.sort(0)), lambda d: [make("transposed", d)],
             True),
    "topk": (lambda x: x.topk(2, 1)[0], lambda d: [make("odd", d)], True),
    "histc": (lambda x: (torch.histc(x, 7), torch.histc(x, 4, -1, 1)), lambda d: [make("transposed", d)], False),
    "scatter_": (lambda x, i: x.clone().scatter_(1, i, 2.5), lambda d: [make("odd", d), torch.tensor(
        [[0, 4], [1, 2], [3, 2]], device=DEVICE)], False),
    # A mixture of experts' grouped matmul (transformers' MoE layers): forward and both weight gradients.
    "_grouped_mm": (lambda a, w, offs: torch._grouped_mm(a, w, offs), lambda d: [
        torch.randn(10, 8, device=DEVICE, dtype=d), torch.randn(3, 8, 8, device=DEVICE, dtype=d),
        torch.tensor([3, 3, 10], dtype=torch.int32, device=DEVICE)], True),
    "log_sigmoid_forward": (torch.nn.functional.logsigmoid, lambda d: [make("transposed", d) * 10], True),
    "select_backward": (lambda x: x[1] * 2, lambda d: [make("transposed", d)], True),
    "slice_backward": (lambda x: x[1:, ::2] * 2, lambda d: [make("transposed", d)], True),
    # The CPU's attention op (F.scaled_dot_product_attention, transformers' sdpa), with each kind of mask.
    "_scaled_dot_product_flash_attention_for_cpu": (lambda q, k, v, m: (
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.zeros(m.shape, dtype=q.dtype).masked_fill(m.logical_not(), float("-inf")),
            scale=0.3, enable_gqa=True)),
        lambda d: [torch.randn(2, 4, 5, 8, dtype=d), torch.randn(2, 2, 6, 8, dtype=d).transpose(1, 2).contiguous()
                   .transpose(1, 2), torch.randn(2, 2, 6, 8, dtype=d), torch.rand(5, 6) > 0.3], True),
    # Composite ops: PyTorch decomposes them into routed ones before any backend.
    "argsort": (lambda x: (x.argsort(1), x.argsort(dim=0, descending=True, stable=True)),
                lambda d: [make("transposed", d)], False),
    "outer": (torch.outer, lambda d: [make("odd", d)[0], make("odd", d, seed=1)[1]], True),
    "isfinite": (lambda x: torch.isfinite(x.log()), lambda d: [make("odd", d)], False),
    "cross_entropy": (lambda x, t: torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1),
                      lambda d: [make("odd", d), torch.tensor([0, 1, 4], device=DEVICE)], True),
}
# The ATen name each case is routed by.
ROUTES = {"nll_loss": ["nll_loss_forward", "nll_loss_backward", "_log_softmax"], "mse_loss": ["mse_loss",
                                                                                               "mse_loss_backward"],
          "slice_backward": ["slice_backward", "mul"], "scatter_": ["scatter"],
          "log_sigmoid_forward": ["log_sigmoid"], "select_backward": ["select_backward", "mul"], "argsort": ["sort"],
          "outer": ["mul"], "isfinite": ["abs", "eq", "ne", "mul"],
          "cross_entropy": ["log_softmax", "nll_loss", "sum", "mean", "mul", "div", "add", "neg", "sub"]}


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("name", sorted(CALLS))
def test_other_ops_match_torch_forward_and_backward(name, dtype):
    if name.endswith("_for_cpu") and DEVICE != "cpu":
        pytest.skip("the CPU's own op: a GPU's attention reaches other ATen ops")
    fn, inputs, backward = CALLS[name]
    args = inputs(dtype)
    include = ROUTES.get(name, [name])
    expected = fn(*args)
    got = routed(include, fn, *args)
    reduced = 5 if name in ("baddbmm", "mv", "linalg_vector_norm", "logsumexp", "var", "std", "sum", "mean",
                            "prod", "cumsum", "native_layer_norm", "nll_loss", "mse_loss", "native_group_norm",
                            "cross_entropy", "_scaled_dot_product_flash_attention_for_cpu", "_grouped_mm") else 1
    close(got, expected, dtype, reduced)
    if not backward:
        return
    leaves = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    twins = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    _backward(fn(*twins))
    with ops.use_kernels(include=include):
        _backward(fn(*leaves))
    for ours, theirs in zip(leaves, twins, strict=True):
        if isinstance(ours, torch.Tensor) and ours.requires_grad and theirs.grad is not None:
            close(ours.grad, theirs.grad, dtype, reduced)


def _backward(out):
    outs = out if isinstance(out, tuple) else (out,)
    total = sum((o.float() * torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)).sum() for o in outs
                if o.is_floating_point() and o.requires_grad)
    total.backward()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [*FLOATS, torch.float64, torch.int32, torch.int64, torch.bool],
                         ids=[*FLOAT_IDS, "fp64", "int32", "int64", "bool"])
def test_sort_argsort_and_topk_match_torch(dtype, layout):
    """Values and indices exactly: the sort is stable (ties in input order, as PyTorch's stable sort), NaN
    last ascending and first descending, -0.0 equal to 0.0; topk's values exactly, its indices pointing at
    them (PyTorch does not promise which of equal values topk returns)."""
    x = make(layout, dtype, seed=3)
    if dtype.is_floating_point and x.numel() > 4:  # NaN, signed zeros, -inf and ties, in the same layout
        base = {"transposed": x.t(), "expanded": x[:1]}.get(layout, x).contiguous()
        base.view(-1)[:4] = torch.tensor([float("nan"), -0.0, 0.0, float("-inf")])
        base.view(-1)[-2:] = base.view(-1)[1]
        x = base.t() if layout == "transposed" else base.expand(3, 5) if layout == "expanded" else base
    elif not dtype.is_floating_point and dtype != torch.bool:
        x = x % 4  # ties
    for dim in range(-1, max(x.dim(), 1) - 1):
        for descending in (False, True):
            options = {"dim": dim, "descending": descending, "stable": True}
            close(routed("sort", lambda t, o=options: torch.sort(t, **o), x), torch.sort(x, **options), dtype)
            close(routed("sort", lambda t, o=options: torch.argsort(t, **o), x), torch.argsort(x, **options), dtype)
            if dtype == torch.bool:
                continue  # PyTorch has no topk of bools
            k = min(2, x.shape[dim] if x.dim() else 1)
            values, index = routed("topk", lambda t, a=(k, dim, descending): torch.topk(t, *a), x)
            expected = torch.topk(x, k, dim, largest=descending)[0]
            close(values, expected, dtype)
            if x.dim():
                close(x.gather(dim, index), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool], ids=["int64", "fp32", "bool"])
def test_run_length_ops_match_torch(dtype):
    """What packed rows are built with: runs (`unique_consecutive`), positions restarting at each document
    (`cummax` of starts) and document ids from lengths (`repeat_interleave`); empty and 0-dim inputs too."""
    runs = torch.tensor([3, 3, 1, 1, 1, 0, 3, 3, 2], device=DEVICE).to(dtype)
    for x in (runs, runs.view(3, 3).t(), runs[:0], runs[4], runs[[0, 1, 2, 0, 1, 2, 3, 4, 5]].view(3, 3)):
        for inverse in (False, True):
            expected = torch.unique_consecutive(x, return_inverse=inverse, return_counts=True)
            close(routed("unique_consecutive", lambda t, i=inverse: torch.unique_consecutive(
                t, return_inverse=i, return_counts=True), x), expected, dtype)
        if x.dim():
            close(routed("cummax", lambda t: t.cummax(-1), x), x.cummax(-1), dtype)
        if x.dim() == 2:  # runs of equal slices along a dimension
            for dim in (0, 1):
                close(routed("unique_consecutive", lambda t, d=dim: torch.unique_consecutive(
                    t, return_inverse=True, return_counts=True, dim=d), x),
                    torch.unique_consecutive(x, return_inverse=True, return_counts=True, dim=dim), dtype)
    for lengths in ([2, 0, 3, 1], [], [0, 0], [5]):
        repeats = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
        close(routed("repeat_interleave", torch.repeat_interleave, repeats), torch.repeat_interleave(repeats),
              torch.int64)


# A GPU's dropout is native_dropout; on the CPU PyTorch composes it of bernoulli_, div_ and mul.
DROPOUT = ["native_dropout", "bernoulli_", "div", "mul"]


def test_dropout_keeps_the_share_and_scales_the_rest():
    x = torch.ones(4000, device=DEVICE)
    out = routed(DROPOUT, lambda t: torch.nn.functional.dropout(t, 0.3, training=True), x)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.03
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.7))
    again = routed(DROPOUT, lambda t: torch.nn.functional.dropout(t, 0.3, training=True), x)
    assert not torch.equal(again, out)  # a new mask each call


def test_random_fills_and_sampling_have_the_right_statistics():
    u = routed("uniform_", lambda t: t.uniform_(-1, 3), torch.empty(20000, device=DEVICE))
    assert u.min() >= -1 and u.max() < 3 and abs(u.mean().item() - 1) < 0.05
    n = routed("normal_", lambda t: t.normal_(2, 0.5), torch.empty(20000, device=DEVICE))
    assert abs(n.mean().item() - 2) < 0.02 and abs(n.std().item() - 0.5) < 0.02
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]], device=DEVICE)
    # 400 draws from two calls of 200 rows (a call takes ~0.25 s under the interpreter, whatever its rows): the
    # rows draw apart (the shares below), and so do the calls (the generator moves on).
    calls = [routed("multinomial", lambda p: torch.multinomial(p, 1), probs.repeat(200, 1)) for _ in range(2)]
    assert not torch.equal(*calls) and all(c.unique().numel() > 1 for c in calls)
    share = torch.bincount(torch.cat(calls).view(-1), minlength=4).float() / 400
    assert share[1] == 0 and abs(share[2].item() - 0.6) < 0.1
    two = routed("multinomial", lambda p: torch.multinomial(p, 2), probs)
    assert two.shape == (1, 2) and two[0, 0] != two[0, 1] and 1 not in two.tolist()[0]


def test_casts_to_bf16_and_fp16_round_to_nearest_even_as_pytorch_does():
    x = torch.randn(10000, device=DEVICE) * 3
    x[:4] = torch.tensor([float("inf"), -float("inf"), 3.4e38, 1.0 + 2**-8])  # overflow; a tie to even
    for dtype in (torch.bfloat16, torch.float16):
        got = routed("_to_copy", lambda t, d=dtype: t.to(d), x)
        assert torch.equal(got, x.to(dtype)), (dtype, (got != x.to(dtype)).sum().item())
    ints = torch.arange(-300, 300, device=DEVICE)
    assert torch.equal(routed("_to_copy", lambda t: t.to(torch.bfloat16), ints), ints.to(torch.bfloat16))
    finite = x[4:].to(torch.bfloat16)
    assert torch.equal(routed("_to_copy", lambda t: t.to(torch.int64), finite), finite.to(torch.int64))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = routed("arange", lambda d=dtype: torch.arange(0, 10, 3, dtype=d, device=DEVICE))
        assert torch.equal(got, torch.arange(0, 10, 3, dtype=dtype)), (dtype, got)


def test_sign_of_nan_is_zero_and_norm_gradients_at_nan_follow_as_pytorch_has_them():
    x = torch.tensor([float("nan"), -2.0, 3.0, 0.0, -0.0, float("-inf")], device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(routed("sign", torch.sign, x.to(dtype)), torch.sign(x.to(dtype)))  # (0 < x) - (x < 0)
    for ord in (1, float("inf"), -float("inf")):
        def grad(routing, ord=ord):
            leaf = x[:4].clone().requires_grad_()
            with routing:
                torch.linalg.vector_norm(leaf, ord).backward()
            return leaf.grad

        ours, theirs = grad(ops.use_kernels()), grad(contextlib.nullcontext())
        assert torch.equal(ours, theirs) and not ours.isnan().any(), (ord, ours, theirs)


def test_histc_bins_16_bit_boundaries_and_refuses_ranges_as_pytorch_does():
    x = torch.linspace(-1, 1, 2001, device=DEVICE)  # many values on or next to a bin edge
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for bins, lo, hi in ((100, 0, 0), (7, -0.3, 0.9), (257, -1, 1)):
            got = routed("histc", lambda t, b=bins, a=lo, z=hi: torch.histc(t, b, a, z), x.to(dtype))
            assert torch.equal(got, torch.histc(x.to(dtype), bins, lo, hi)), (dtype, bins, lo, hi)
    for t, kwargs in ((torch.tensor([1.0, float("inf")]), {}), (torch.tensor([1.0, 2.0]), {"min": 0, "max": math.inf}),
                      (torch.tensor([1.0, 2.0]), {"bins": 0}), (torch.tensor([1.0, 2.0]), {"min": 3, "max": 1}),
                      (torch.tensor([1.0, 2.0], dtype=torch.float16), {"min": 0, "max": 1e5})):
        with pytest.raises(RuntimeError) as theirs:
            torch.histc(t.to(DEVICE), **kwargs)
        with pytest.raises(RuntimeError, match=re.escape(str(theirs.value))), ops.use_kernels(include=["histc"]):
            torch.histc(t.to(DEVICE), **kwargs)


def test_factories_and_foreach_ops_match_torch():
    assert torch.equal(routed("arange", lambda: torch.arange(2, 11, 3, device=DEVICE)), torch.arange(2, 11, 3))
    assert torch.equal(routed("arange", lambda: torch.arange(0.5, 2, 0.25, device=DEVICE)), torch.arange(0.5, 2, 0.25))
    assert torch.equal(routed("full", lambda: torch.full((2, 3), 7, device=DEVICE)), torch.full((2, 3), 7))
    xs = [make("odd", torch.float32, seed=s) for s in range(3)]
    ys = [make("odd", torch.float32, seed=s + 5) for s in range(3)]
    for name, fn in (("_foreach_add", lambda a, b: torch._foreach_add(a, b, alpha=0.5)),
                     ("_foreach_mul", lambda a, b: torch._foreach_mul(a, 1.5)),
                     ("_foreach_lerp", lambda a, b: torch._foreach_lerp(a, b, 0.1)),
                     ("_foreach_addcmul", lambda a, b: torch._foreach_addcmul(a, a, b, 0.3)),
                     ("_foreach_sqrt", lambda a, b: torch._foreach_sqrt([t.abs() for t in a]))):
        close(routed(name, fn, xs, ys), fn(xs, ys), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.uint8], ids=["bool", "int32", "uint8"])
def test_bitwise_not_and_logical_ops_keep_bools_bools(dtype):
    x = make("odd", dtype) if dtype != torch.uint8 else make("odd", torch.int32).abs().to(torch.uint8)
    close(routed("bitwise_not", torch.bitwise_not, x), torch.bitwise_not(x), dtype)
    close(routed("bitwise_and", torch.bitwise_and, x, x.flip(0)), torch.bitwise_and(x, x.flip(0)), dtype)
