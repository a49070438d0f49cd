"""The op tests of the multi-tensor kernels (ops/multi_tensor.py): gradient clipping's norms, scale and stack,
against PyTorch's own ops, called directly and routed (`torch.nn.utils.clip_grad_norm_` under
`ops.use_kernels()`)."""

from __future__ import annotations

import math

import pytest
import torch

import ops
from ops.aten import calls
from tests.ops.conftest import DEVICE
from tests.ops.families.common import _tolerance

SHAPES = [(37, 5), (1100,), (1,), (3, 4, 5), (0, 3), (2049,)]


def _tensors(dtype, scale=3.0):
    return [(torch.randn(s, dtype=torch.float64) * scale).to(device=DEVICE, dtype=dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_foreach_norm_and_vector_norm_match_torch(dtype):
    xs = _tensors(dtype)
    atol, rtol = _tolerance(dtype, reduced=10)
    got = ops.foreach_norm(xs)
    for x, norm in zip(xs, got, strict=True):
        assert norm.dtype == dtype and norm.shape == ()
        torch.testing.assert_close(norm.double(), torch.linalg.vector_norm(x.double()), atol=atol, rtol=rtol)
    mixed = ops.foreach_norm([xs[0], xs[1].float()], dtype=torch.float32)  # two dtypes: a launch each
    assert [n.dtype for n in mixed] == [torch.float32, torch.float32]
    x = xs[3]
    for dim, keepdim in ((None, False), ([0, 2], False), (1, True), ([0, 1, 2], True)):
        expected = torch.linalg.vector_norm(x.double(), 2, dim, keepdim)
        got_norm = ops.vector_norm(x, 2, dim, keepdim)
        assert got_norm.shape == expected.shape
        torch.testing.assert_close(got_norm.double(), expected, atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="foreach_norm: ord=1; the kernels compute 2-norms"):
        ops.foreach_norm(xs, ord=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_foreach_mul_and_stack_match_torch(dtype):
    xs = _tensors(dtype)
    expected = [x.double() * 0.37 for x in xs]
    ops.foreach_mul_(xs, torch.tensor(0.37, device=DEVICE))
    atol, rtol = _tolerance(dtype)
    for x, e in zip(xs, expected, strict=True):
        torch.testing.assert_close(x.double(), e, atol=atol, rtol=rtol)
    a, b = xs[3], xs[3] * 2
    for dim in (0, 1, -1, 3):
        assert torch.equal(ops.stack([a, b, a], dim), torch.stack([a, b, a], dim))
    scalars = [torch.tensor(float(i), device=DEVICE) for i in range(5)]
    assert torch.equal(ops.stack(scalars), torch.arange(5.0, device=DEVICE))
    assert ops.stack([a.float(), a.half()]).dtype == torch.float32  # torch's promotion
    with pytest.raises(ValueError, match=r"stack: every tensor must have shape \(3, 4, 5\)"):
        ops.stack([a, xs[0]])
    with pytest.raises(ValueError, match=r"foreach_mul_: scale of shape \(2,\); one element"):
        ops.foreach_mul_(xs, torch.ones(2, device=DEVICE))


def test_clipping_runs_in_our_kernels_and_clips_as_torch_does():
    """clip_grad_norm_ under ops.use_kernels(): each gradient's norm, their norm, the scale and the in-place
    multiply all reach ours, and give torch's norm and clipped gradients; another order (inf) still works."""
    torch.manual_seed(0)
    grads = _tensors(torch.float32)
    ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, q, g in zip(ours, theirs, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    names = ("_foreach_norm.Scalar", "stack", "linalg_vector_norm", "_foreach_mul_.Tensor")
    before = {n: calls[n] for n in names}
    with ops.use_kernels():
        norm = torch.nn.utils.clip_grad_norm_(ours, 1.0)
        inf_norm = torch.nn.utils.get_total_norm([p.grad for p in ours if p.numel()], math.inf)
    # The inf norm's calls are routed too (and computed from PyTorch's abs and amax, ord != 2).
    assert {n: calls[n] - before[n] for n in names} == dict(zip(names, (2, 2, 2, 1), strict=True))
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    torch.testing.assert_close(norm, expected, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(inf_norm, max(q.grad.abs().max() for q in theirs if q.numel()))
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
