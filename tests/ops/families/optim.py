"""The op tests of the fused AdamW step."""

from __future__ import annotations

import pytest
import torch

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import _leaf, _tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adamw_steps_as_torch_does(dtype):
    """Three steps of ours against torch.optim.AdamW on float64 copies of the same parameters and grads."""
    params = [_leaf(37, 5, dtype=dtype), _leaf(1100, dtype=dtype), _leaf(1, dtype=dtype)]
    refs = [p.detach().double().requires_grad_() for p in params]
    kwargs = {"lr": 0.1, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    ours, ref = ops.AdamW(params, **kwargs), torch.optim.AdamW(refs, **kwargs)
    for _ in range(3):
        for p, r in zip(params, refs, strict=True):
            g = torch.randn(p.shape, dtype=torch.float64, device=DEVICE)
            p.grad, r.grad = g.to(dtype), g.to(dtype).double()
        ours.step()
        ref.step()
    atol, rtol = _tolerance(dtype)
    for p, r in zip(params, refs, strict=True):
        torch.testing.assert_close(p.detach().double(), r.detach(), atol=atol, rtol=rtol)
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"].double(), ref.state[r]["exp_avg_sq"], atol=atol,
                                   rtol=rtol)
    assert ours.state[params[0]]["step"] == 3
    with pytest.raises(ValueError, match=r"betas=\(1.0, 0.9\): each must be in \[0, 1\)"):
        ops.AdamW(params, betas=(1.0, 0.9))
