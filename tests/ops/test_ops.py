"""Every op against a float64 PyTorch reference, forward and backward, under Triton's interpreter.

Shapes are small, with non-power-of-two sizes and non-contiguous inputs. fp32 values and gradients
must match within atol = 1e-4 x (reduced length) and rtol = 1.3e-6 (FlagGems' bar); bf16 within
atol = 2e-2 and rtol = 1.6e-2 (PyTorch's bf16 rtol: one bf16 rounding of the result).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl  # noqa: F401 - a @triton.jit function needs it in its module's globals

import ops

torch.manual_seed(0)


def _leaf(*shape, dtype=torch.float32, transpose=False):
    x = torch.randn(*shape, dtype=torch.float64)
    if transpose:  # a non-contiguous view of the same values
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x.to(dtype).requires_grad_()


def _check(ours, ref, inputs, reduced=1, dtype=torch.float32, grad=None):
    """Compare forward values and input gradients of ours(*inputs) with ref(*float64 copies)."""
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None
    refs = [t.detach().double().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in inputs]
    out, expected = ours(*inputs), ref(*refs)
    atol, rtol = (1e-4 * reduced, 1.3e-6) if dtype == torch.float32 else (2e-2, 1.6e-2)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    g = torch.randn_like(expected) if grad is None else grad
    out.backward(g.to(out.dtype))
    expected.backward(g)
    for t, r in zip(inputs, refs, strict=True):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            torch.testing.assert_close(t.grad.double(), r.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations(dtype):
    x, y = _leaf(3, 37, 5, dtype=dtype, transpose=True), _leaf(3, 37, 5, dtype=dtype)
    _check(ops.silu, F.silu, [x], dtype=dtype)
    _check(lambda a: ops.gelu(a), lambda a: F.gelu(a), [_leaf(7, 33, dtype=dtype)], dtype=dtype)
    _check(lambda a: ops.gelu(a, "tanh"), lambda a: F.gelu(a, approximate="tanh"), [_leaf(7, 33, dtype=dtype)],
           dtype=dtype)
    _check(ops.silu_and_mul, lambda a, b: F.silu(a) * b, [x, y], dtype=dtype)
    _check(lambda a, b: ops.gelu_and_mul(a, b, "tanh"), lambda a, b: F.gelu(a, approximate="tanh") * b,
           [_leaf(5, 19, dtype=dtype), _leaf(5, 19, dtype=dtype)], dtype=dtype)


def test_pointwise_broadcasts_promotes_and_takes_strides():
    add = ops.add
    a = torch.arange(12, dtype=torch.int32).view(3, 4)
    b = torch.randn(4, dtype=torch.float64)[None, :].expand(3, 4)
    out = add(a.t(), torch.ones(3))  # (4, 3) strided, broadcast against (3,)
    assert out.dtype == torch.float32 and torch.equal(out, a.t().float() + 1)
    assert add(a, b).dtype == torch.float64
    assert add(a, a).dtype == torch.int32 and torch.equal(add(a, a), a * 2)
    with pytest.raises(TypeError, match="takes 2 tensors"):
        add(a)
    assert ops.div(a, a + 1).dtype == torch.float32 and torch.allclose(ops.div(a, a + 1), a / (a + 1))
    assert torch.equal(ops.sub(a, 1), a - 1) and torch.equal(ops.mul(a, a), a * a)
    assert torch.equal(ops.maximum(a, torch.full((4,), 5, dtype=torch.int32)), torch.clamp(a, min=5))

    @ops.pointwise(3, "float")
    @triton.jit
    def lerp(x, y, w):
        return x + w * (y - x)

    x, y = torch.randn(5, 6), torch.randn(6)
    torch.testing.assert_close(lerp(x, y, torch.tensor(0.25)), torch.lerp(x, y.expand(5, 6), 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(dtype, weighted):
    x = _leaf(4, 9, 24, dtype=dtype, transpose=True)
    w = _leaf(24, dtype=dtype) if weighted else None
    inputs = [x, w] if weighted else [x]
    _check(lambda a, *b: ops.rms_norm(a, (24,), *b, eps=1e-6), lambda a, *b: F.rms_norm(a, (24,), *b, eps=1e-6),
           inputs, reduced=24, dtype=dtype)


def test_layer_norm_over_two_dims():
    x, w, b = _leaf(6, 5, 3, 7), _leaf(3, 7), _leaf(3, 7)
    _check(lambda a, c, d: ops.layer_norm(a, (3, 7), c, d), lambda a, c, d: F.layer_norm(a, (3, 7), c, d),
           [x, w, b], reduced=21 * 6 * 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding(dtype):
    from trainer.models.llama import apply_rotary  # the model's eager reference

    q, k = _leaf(2, 7, 3, 12, dtype=dtype), _leaf(2, 7, 1, 12, dtype=dtype)
    angles = torch.outer(torch.arange(7.0), torch.rand(6))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def ours(a, b):
        qo, ko = ops.rotary_embedding(a, b, cos, sin)
        return torch.cat([qo.flatten(), ko.flatten()])

    def ref(a, b):
        qo, ko = apply_rotary(a, b, cos.double(), sin.double())
        return torch.cat([qo.flatten(), ko.flatten()])

    _check(ours, ref, [q, k], dtype=dtype)


@pytest.mark.parametrize(("reduction", "smoothing"), [("mean", 0.0), ("sum", 0.1), ("none", 0.0), ("mean", 0.2)])
def test_cross_entropy(reduction, smoothing):
    logits = _leaf(11, 1037)  # more than one vocabulary block
    target = torch.randint(0, 1037, (11,))
    target[[2, 5]] = -100
    _check(lambda a: ops.cross_entropy(a, target, reduction=reduction, label_smoothing=smoothing),
           lambda a: F.cross_entropy(a, target, reduction=reduction, label_smoothing=smoothing),
           [logits], reduced=1037)


def test_cross_entropy_with_class_dim_and_bf16():
    logits, target = _leaf(2, 33, 5, dtype=torch.bfloat16), torch.randint(0, 33, (2, 5))
    _check(lambda a: ops.cross_entropy(a, target), lambda a: F.cross_entropy(a, target), [logits], reduced=33,
           dtype=torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_linear_cross_entropy(bias, reduction):
    hidden, weight = _leaf(2, 13, 24), _leaf(259, 24)
    b = _leaf(259) if bias else None
    target = torch.randint(0, 259, (2, 13))
    target[0, :3] = -100
    inputs = [hidden, weight] + ([b] if bias else [])

    def ours(h, w, *bb):
        return ops.fused_linear_cross_entropy(h, w, target, *bb, reduction=reduction, chunk_rows=7)

    def ref(h, w, *bb):
        return F.cross_entropy(F.linear(h, w, *bb).flatten(0, 1), target.flatten(), reduction=reduction)

    _check(ours, ref, inputs, reduced=259, grad=torch.tensor(0.7, dtype=torch.float64))


@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_and_log_softmax(dim):
    x = _leaf(3, 1100, 5, transpose=True)  # longer than one block
    _check(lambda a: ops.softmax(a, dim), lambda a: torch.softmax(a, dim), [x], reduced=1100)
    _check(lambda a: ops.log_softmax(a, dim), lambda a: torch.log_softmax(a, dim), [x], reduced=1100)


@pytest.mark.parametrize("bias_shape", [(29,), (37, 29), (37, 1)])
def test_addmm(bias_shape):
    bias, a, b = _leaf(*bias_shape), _leaf(37, 50), _leaf(29, 50).detach().t().requires_grad_()
    b.retain_grad()
    _check(lambda c, x, y: ops.addmm(c, x, y, beta=0.5, alpha=2.0),
           lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0), [bias, a, b], reduced=50)


def test_aten_ops_route_to_our_kernels_and_back():
    from ops.aten import calls

    x = _leaf(4, 33)
    ref = F.silu(x.detach().double())
    before = dict(calls)
    with ops.use_kernels(exclude=["addmm"]):
        assert "silu" in ops.registered() and "addmm" not in ops.registered()
        y = F.silu(x)
        y.backward(torch.ones_like(y))
        z = torch.log_softmax(x.detach(), dim=0)
        g = F.gelu(x.detach(), approximate="tanh")
    assert calls["silu"] == before.get("silu", 0) + 1 and calls["silu_backward"] == before.get("silu_backward", 0) + 1
    assert calls["_log_softmax"] == before.get("_log_softmax", 0) + 1 and calls["gelu"] == before.get("gelu", 0) + 1
    torch.testing.assert_close(y.double(), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(z, torch.log_softmax(x.detach(), dim=0))
    torch.testing.assert_close(g, F.gelu(x.detach(), approximate="tanh"))
    assert ops.registered() == []
    F.silu(x.detach())
    assert calls["silu"] == before.get("silu", 0) + 1  # PyTorch's own kernel again
    with pytest.raises(ValueError, match="not routable: softmax_v9"):
        ops.enable(include=["softmax_v9"])
