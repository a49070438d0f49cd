"""The ops that complete a training step's coverage (bench/coverage.py): the comparisons, clamps and
reciprocals of the loss's token count, in-place and out= pointwise ops, and the in-place and out= matmuls
of the fused loss (`addmm_`, `mm.out`), each against PyTorch (exact where the result is exact, else in
float64), called directly and routed through `ops.use_kernels()`. Small shapes: they run under Triton's
interpreter on a machine without a GPU (tests/ops/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
from ops.aten import calls
from tests.ops.conftest import DEVICE


def _values(*shape, dtype=torch.float32):
    return (torch.randn(*shape, dtype=torch.float64) * 3).to(device=DEVICE, dtype=dtype)


@pytest.mark.timeout(300)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64]),
       bounds=st.sampled_from([(-1, 1), (None, 0.5), (-0.5, None), (2, -2)]), broadcast=st.booleans())
def test_comparisons_clamps_and_reciprocals_match_torch(shape, dtype, bounds, broadcast):
    torch.manual_seed(len(shape))
    x = _values(*shape, dtype=dtype)
    other = _values(shape[-1], dtype=dtype) if broadcast else x.flip(0)  # a broadcast row, or strides < 0
    low, high = bounds  # (2, -2): min above max, where torch gives max everywhere
    assert torch.equal(ops.ne(x, other), x != other) and ops.ne(x, other).dtype == torch.bool
    assert torch.equal(ops.ne(x, 0), x != 0)
    assert torch.equal(ops.clamp(x, low, high), torch.clamp(x, low, high))
    assert torch.equal(ops.minimum(x, other), torch.minimum(x, other))
    expected = torch.reciprocal(x.double())
    got = ops.reciprocal(x)
    assert got.dtype == torch.reciprocal(x).dtype  # integers become the default float dtype
    tol = {"atol": 0, "rtol": 1e-2} if dtype in (torch.bfloat16, torch.float16) else {"atol": 0, "rtol": 1e-6}
    torch.testing.assert_close(got.double(), expected, equal_nan=True, **tol)


def test_clamp_keeps_nans_and_takes_tensor_bounds():
    x = torch.tensor([float("nan"), -3.0, 0.2, 5.0], device=DEVICE)
    torch.testing.assert_close(ops.clamp(x, -1, 1), torch.clamp(x, -1, 1), equal_nan=True)
    low, high = torch.full((4,), -2.0, device=DEVICE), torch.tensor([0.0, 1.0, 0.1, 2.0], device=DEVICE)
    torch.testing.assert_close(ops.clamp(x, low, high), torch.clamp(x, low, high), equal_nan=True)
    with pytest.raises(ValueError, match="clamp: give min, max or both"):
        ops.clamp(x)


def test_pointwise_ops_write_into_out():
    x, y = _values(5, 6), _values(6)
    out = torch.empty(5, 6, device=DEVICE)
    assert ops.mul(x, y, out=out) is out
    torch.testing.assert_close(out, x * y)
    same = x.clone()
    ops.add(same, same, out=same)  # in place: each element is read before it is written, by one program
    torch.testing.assert_close(same, 2 * x)
    bf16 = torch.empty(5, 6, dtype=torch.bfloat16, device=DEVICE)
    ops.mul(x, x, out=bf16)  # computed in fp32, rounded once into out's dtype
    torch.testing.assert_close(bf16, (x * x).to(torch.bfloat16), atol=0, rtol=2**-7)
    with pytest.raises(ValueError, match=r"mul: out \(6, 5\) must have the broadcast shape \(5, 6\)"):
        ops.mul(x, y, out=torch.empty(6, 5, device=DEVICE))
    strided = torch.empty(6, 5, device=DEVICE).t()  # out= through its strides (how in-place ops run)
    torch.testing.assert_close(ops.mul(x, y, out=strided), x * y)
    with pytest.raises(ValueError, match=r"mul: out \(5, 6\) is an expanded view"):
        ops.mul(x, y, out=torch.empty(6, device=DEVICE).expand(5, 6))
    with pytest.raises(ValueError, match="silu_mul_bwd returns 2 tensors: out= takes one-output ops only"):
        ops.activations.silu_mul_bwd(x, x, x, out=out)


def test_matmul_writes_into_out_and_refuses_a_wrong_shape():
    a, b, c = _values(5, 7), _values(7, 3), _values(5, 3)
    out = torch.empty(3, 5, device=DEVICE).t()  # any strides
    ops.blas.matmul(a, b, out=out)
    torch.testing.assert_close(out.double(), a.double() @ b.double(), atol=1e-4, rtol=1e-5)
    acc = c.clone()
    ops.blas.matmul(a, b, acc, 0.5, 2.0, out=acc)  # acc = 2 acc + 0.5 a @ b, read and written in place
    torch.testing.assert_close(acc.double(), 2 * c.double() + 0.5 * (a.double() @ b.double()), atol=1e-4,
                               rtol=1e-5)
    with pytest.raises(ValueError, match=r"out \(5, 4\): the product of mat1 \(5, 7\) and mat2 \(7, 3\) is \(5, 3\)"):
        ops.blas.matmul(a, b, out=torch.empty(5, 4, device=DEVICE))


def test_routed_in_place_and_out_forms_match_torch():
    """What the fused loss calls under `ops.enable()`: `addmm_`, `mm.out`, `mul_`, then the token count's
    `ne`, `clamp` and `reciprocal`; each routed call is counted and gives torch's result."""
    a, b, c, g = _values(6, 4), _values(4, 5), _values(6, 5), _values(5)
    target = torch.tensor([3, -100, 1, -100], device=DEVICE)
    names = ("addmm_", "mm.out", "mul_.Tensor", "ne.Scalar", "clamp", "reciprocal")
    before = {name: calls[name] for name in names}
    with ops.use_kernels():
        acc = c.clone().addmm_(a, b, beta=0.5, alpha=2.0)
        product = torch.empty(6, 5, device=DEVICE)
        torch.mm(a, b, out=product)
        scaled = c.clone().mul_(g)  # a broadcast row, in place
        narrow = c[:, :1].clone().t()  # (1, 6), non-contiguous after t(): computed, then copied back
        narrow.mul_(2.0)
        rows = c.clone()
        rows.mul_(rows[0])  # reads its own first row: computed apart, then copied back
        count = (target != -100).sum().clamp(min=1).to(torch.float32)
        scale = 1.0 / count
    assert all(calls[name] > before[name] for name in names), {n: calls[n] - before[n] for n in names}
    a64, b64, c64 = (t.double() for t in (a, b, c))
    torch.testing.assert_close(acc.double(), 0.5 * c64 + 2.0 * a64 @ b64, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(product.double(), a64 @ b64, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(scaled, c * g)
    torch.testing.assert_close(narrow, 2.0 * c[:, :1].t())
    torch.testing.assert_close(rows, c * c[0])
    assert count.item() == 2.0 and scale.item() == 0.5
