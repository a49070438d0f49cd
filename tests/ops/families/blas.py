"""The op tests of addmm, mm and bmm, and the matmul tile settings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import GENERATED, _check, _leaf, dtypes


@pytest.mark.parametrize("bias_shape", [(29,), (37, 29), (37, 1)])
def test_addmm(bias_shape, dtype):
    bias, a, b = _leaf(*bias_shape, dtype=dtype), _leaf(37, 50, dtype=dtype), _leaf(29, 50, dtype=dtype)
    b = b.detach().t().requires_grad_()
    _check(lambda c, x, y: ops.addmm(c, x, y, beta=0.5, alpha=2.0),
           lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0), [bias, a, b], reduced=50, dtype=dtype)


@pytest.mark.timeout(300)
@GENERATED
@given(m=st.integers(1, 70), k=st.integers(1, 70), n=st.integers(1, 70), dtype=dtypes,
       bias=st.sampled_from(["row", "full", "column"]), transposed=st.booleans(), tf32=st.booleans())
def test_addmm_generated(m, k, n, dtype, bias, transposed, tf32):
    shape = {"row": (n,), "full": (m, n), "column": (m, 1)}[bias]
    b = _leaf(n, k, dtype=dtype).detach().t().requires_grad_() if transposed else _leaf(k, n, dtype=dtype)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        # TF32 keeps 10 mantissa bits, as fp16 does.
        check_dtype = torch.float16 if tf32 and dtype == torch.float32 and DEVICE == "cuda" else dtype
        _check(lambda c, x, y: ops.addmm(c, x, y, beta=0.5, alpha=2.0),
               lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0),
               [_leaf(*shape, dtype=dtype), _leaf(m, k, dtype=dtype), b], reduced=k * 4, dtype=check_dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_addmm_settings_use_large_tiles_for_large_products():
    from ops.blas import _precision
    from ops.settings import matmul_settings

    big = matmul_settings(4096, 4096, 4096, torch.bfloat16)
    assert (big["BM"], big["BN"], big["BK"], big["num_warps"]) == (128, 256, 64, 8)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert _precision(torch.float32) == "tf32" and _precision(torch.bfloat16) == "ieee"
        torch.backends.cuda.matmul.allow_tf32 = False
        assert _precision(torch.float32) == "ieee"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_addmm_ignores_the_bias_when_beta_is_zero():
    bias = torch.full((3, 5), float("nan"), device=DEVICE)
    a, b = torch.randn(3, 4, device=DEVICE), torch.randn(4, 5, device=DEVICE)
    torch.testing.assert_close(ops.addmm(bias, a, b, beta=0), torch.addmm(bias, a, b, beta=0))


@pytest.mark.parametrize("batched", [False, True], ids=["mm", "bmm"])
def test_mm_and_bmm(batched, dtype):
    lead = (3,) if batched else ()
    a = _leaf(*lead, 37, 50, dtype=dtype)
    b = _leaf(*lead, 29, 50, dtype=dtype).detach().transpose(-1, -2).requires_grad_()  # strided, as linear's
    ours, ref = (ops.bmm, torch.bmm) if batched else (ops.mm, torch.mm)
    _check(ours, ref, [a, b], reduced=50, dtype=dtype)
    with pytest.raises(ValueError, match="mm takes two matrices"):
        ops.mm(a.detach()[None], b.detach())
