"""The op tests of the generated pointwise kernels: broadcasting, type promotion, strides, scalars, integer results."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import GENERATED, _tolerance


@pytest.mark.parametrize("name", ["_pw_TT_o1_r2", "_pw_TST_o3_r1"])
def test_generated_kernels_are_found_by_name(name):
    import sys

    kernel = getattr(sys.modules["ops.pointwise_codegen"], name)
    assert kernel.fn.__name__ == name


def test_pointwise_broadcasts_promotes_takes_strides_and_scalars():
    add = ops.add
    a = torch.arange(12, dtype=torch.int32, device=DEVICE).view(3, 4)
    b = torch.randn(4, dtype=torch.float64, device=DEVICE)[None, :].expand(3, 4)
    ones = torch.ones(3, device=DEVICE)
    out = add(a.t(), ones)  # (4, 3) strided, broadcast against (3,)
    assert out.dtype == torch.float32 and torch.equal(out, a.t().float() + 1)
    assert add(a, b).dtype == torch.float64
    assert add(a, a).dtype == torch.int32 and torch.equal(add(a, a), a * 2)
    with pytest.raises(TypeError, match="takes 2 tensors or numbers"):
        add(a)
    assert ops.div(a, a + 1).dtype == torch.float32 and torch.allclose(ops.div(a, a + 1), a / (a + 1))
    assert torch.equal(ops.sub(a, 1), a - 1) and torch.equal(ops.mul(a, a), a * a)
    assert torch.equal(ops.maximum(a, torch.full((4,), 5, dtype=torch.int32, device=DEVICE)), torch.clamp(a, min=5))
    assert ops.mul(a, 2.5).dtype == torch.float32 and torch.equal(ops.mul(a, 2.5), a * 2.5)  # a Python scalar
    x, y = torch.randn(5, 6, device=DEVICE), torch.randn(6, device=DEVICE)
    torch.testing.assert_close(lerp(x, y, 0.25), torch.lerp(x, y.expand(5, 6), 0.25))
    torch.testing.assert_close(lerp(x, y, torch.tensor(0.25, device=DEVICE)), torch.lerp(x, y.expand(5, 6), 0.25))
    low, high = min_max(x, y)
    assert torch.equal(low, torch.minimum(x, y)) and torch.equal(high, torch.maximum(x, y))
    with pytest.raises(ValueError, match="takes 2 arguments"):
        ops.pointwise(3)(sub_fn)
    with pytest.raises(TypeError, match="at least one tensor"):
        ops.add(1, 2)


@ops.pointwise(promote="float")
@triton.jit
def lerp(x, y, w):
    return x + w * (y - x)


@ops.pointwise(outputs=2)
@triton.jit
def min_max(x, y):
    return tl.minimum(x, y), tl.maximum(x, y)


@triton.jit
def sub_fn(x, y):
    return x - y


def _broadcast_views(draw_shape, pattern, transpose):
    """A tensor of `draw_shape` seen through a broadcast (size-1 dims from `pattern`) and maybe transposed."""
    shape = [1 if drop else size for size, drop in zip(draw_shape, pattern, strict=True)]
    t = torch.randn(shape, dtype=torch.float64).to(DEVICE)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    return t


@pytest.mark.timeout(300)
@GENERATED
@given(shape=st.lists(st.integers(1, 7), min_size=0, max_size=4), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32]))
def test_pointwise_generated(shape, data, dtype):
    n = len(shape)
    a = _broadcast_views(shape, data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), data.draw(st.booleans()))
    b = _broadcast_views(shape, data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), data.draw(st.booleans()))
    a, b = (a * 10).to(dtype), (b * 10).to(dtype)
    scalar = data.draw(st.sampled_from([None, 2, -1.5]))
    for ours, ref in ((ops.add, torch.add), (ops.mul, torch.mul), (ops.maximum, torch.maximum),
                      (ops.sub, torch.sub)):
        other = b if scalar is None else scalar
        got = ours(a, other)
        # torch.maximum takes no Python number: a 0-d tensor promotes as one does.
        expected = ref(a, torch.tensor(other, device=DEVICE) if ours is ops.maximum and scalar is not None else other)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        atol, rtol = _tolerance(dtype if dtype.is_floating_point else torch.float32)
        torch.testing.assert_close(got.double(), expected.double(), atol=atol, rtol=rtol)


def test_integer_pointwise_results_are_exact():
    a = torch.tensor([2**30 + 1, -(2**40) - 3, 7], dtype=torch.int64, device=DEVICE)
    assert torch.equal(ops.add(a, a), a + a) and torch.equal(ops.mul(a, 3), a * 3)
    assert torch.equal(ops.maximum(a, torch.tensor(0, device=DEVICE)), torch.clamp(a, min=0))
