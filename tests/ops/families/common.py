"""What every op family's tests check with: inputs, tolerances, and `_check` (ours against a float64
reference, forward and backward)."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st

from tests.ops.conftest import DEVICE, DTYPES

torch.manual_seed(0)
GENERATED = settings(max_examples=12, deadline=None, derandomize=True)
dtypes = st.sampled_from(DTYPES)


def _leaf(*shape, dtype=torch.float32, transpose=False, scale=1.0):
    x = torch.randn(*shape, dtype=torch.float64) * scale
    if transpose and len(shape) >= 2:  # a non-contiguous view of the same values
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x.to(device=DEVICE, dtype=dtype).requires_grad_()


def _tolerance(dtype, reduced=1):
    if dtype == torch.float32:
        return 1e-4 * reduced, 1.3e-6
    if dtype == torch.float16:
        return 2e-3, 2e-3
    return 2e-2, 1.6e-2


def _close(got, expected, atol, rtol, eager=None):
    """assert_close, or for a 16-bit op whose formula loses precision as PyTorch's own does (a backward
    from the rounded output): within the tolerance plus twice eager's own error, element by element."""
    if eager is None:
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        return
    allowed = atol + rtol * expected.abs() + 2 * (eager - expected).abs()
    excess = (got - expected).abs() - allowed
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements off by up to {excess.max().item():.3g} more " \
                              f"than allowed (atol {atol}, rtol {rtol}, twice eager's error)"


def _check(ours, ref, inputs, reduced=1, dtype=torch.float32, grad=None, like_eager=False):
    """Compare forward values and input gradients of ours(*inputs) with ref(*float64 copies); with
    `like_eager`, a 16-bit result may also be as far off as ref(*inputs) in that dtype is, twice."""
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None
    refs = [t.detach().double().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in inputs]
    out, expected = ours(*inputs), ref(*refs)
    atol, rtol = _tolerance(dtype, reduced)
    g = (torch.randn_like(expected) if grad is None else grad.to(DEVICE)).to(out.dtype)
    eager = [None] * (len(inputs) + 1)
    if like_eager and dtype != torch.float32:
        copies = [t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs]
        eager_out = ref(*copies)
        eager_out.backward(g)
        eager = [eager_out.double()] + [c.grad.double() if isinstance(c, torch.Tensor) and c.grad is not None
                                        else None for c in copies]
    _close(out.double(), expected, atol, rtol, eager[0])
    out.backward(g)
    expected.backward(g.double())
    for i, (t, r) in enumerate(zip(inputs, refs, strict=True)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            _close(t.grad.double(), r.grad, atol, rtol, eager[i + 1])
