"""The op tests of sum."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import GENERATED, _tolerance


@pytest.mark.timeout(300)
@GENERATED
@given(shape=st.lists(st.integers(1, 9), min_size=0, max_size=3), long_row=st.booleans(), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32]), keepdim=st.booleans())
def test_sum_generated(shape, long_row, data, dtype, keepdim):
    if long_row:  # a row longer than one block is summed block by block
        shape = [2, 9000]
    n = len(shape)
    dims = data.draw(st.one_of(st.none(), st.lists(st.integers(0, n - 1), unique=True, max_size=n))) if n else None
    if dims:
        dims = [d - n if d % 2 else d for d in dims]  # negative dimensions too
    x = (torch.randn(shape, dtype=torch.float64) * 10).to(device=DEVICE, dtype=dtype)
    if n >= 2 and data.draw(st.booleans()):
        x = x.transpose(0, -1)  # reduced dimensions that are not innermost
    if dtype.is_floating_point:
        x.requires_grad_()
    got = ops.sum(x, dims, keepdim)
    expected = torch.sum(x.double(), dim=dims, keepdim=keepdim)
    assert got.dtype == (torch.int64 if dtype == torch.int32 else dtype) and got.shape == expected.shape
    atol, rtol = _tolerance(dtype if dtype.is_floating_point else torch.float32, reduced=max(1, x.numel()))
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)
    if x.requires_grad:  # the gradient: the incoming one expanded over the summed dimensions
        g = torch.randn(got.shape, dtype=torch.float64, device=DEVICE)
        got.backward(g.to(dtype))
        torch.testing.assert_close(x.grad.double(), torch.autograd.grad(expected, x, g)[0].double())
        x = x.detach()
    with ops.use_kernels(include=["sum"]):  # routed: torch.sum and x.sum(dim) land here, and match
        routed = torch.sum(x, dim=dims, keepdim=keepdim)
    assert torch.equal(routed, got)
