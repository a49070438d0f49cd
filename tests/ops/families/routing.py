"""The op tests of ATen routing: which torch calls reach our kernels (`ops.enable`, `ops.use_kernels`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import _leaf


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
    with pytest.raises(ValueError, match="not routable: softmax_v9; the ops are .*log_softmax"):
        ops.enable(include=["softmax_v9"])


def test_use_kernels_takes_our_public_names():
    from ops.aten import calls

    x = _leaf(3, 10)
    with ops.use_kernels(include=["softmax", "gelu"]):
        assert set(ops.registered()) == {"_softmax", "_softmax_backward_data", "gelu", "gelu_backward"}
        before = calls["_softmax_backward_data"]
        torch.softmax(x, -1).sum().backward()
        assert calls["_softmax_backward_data"] == before + 1
    with ops.use_kernels(exclude=["softmax", "addmm"]):
        assert "_softmax" not in ops.registered() and "_log_softmax" in ops.registered()
        assert "addmm" not in ops.registered()
    with ops.use_kernels(include=["_log_softmax"]):
        assert ops.registered() == ["_log_softmax"]
    assert ops.registered() == []


def test_aten_routes_the_matmuls_embedding_and_arithmetic():
    from ops.aten import calls

    a, b, w = _leaf(6, 10), _leaf(10, 7), _leaf(13, 10)
    idx = torch.randint(0, 13, (2, 3), device=DEVICE)
    before = dict(calls)
    with ops.use_kernels(include=["mm", "bmm", "embedding", "add", "sub", "mul", "div"]):
        y = (a @ b) * 2.0 + torch.bmm(a[None], b[None])[0] / 3.0 - F.embedding(idx, w).sum()
        y.sum().backward()
        z = torch.add(a, a, alpha=3)
    for name in ("mm", "bmm", "embedding", "embedding_dense_backward", "add.Tensor", "sub.Tensor", "mul.Tensor",
                 "div.Tensor"):
        assert calls[name] > before.get(name, 0), name
    torch.testing.assert_close(z, 4 * a.detach())
    a64, b64, w64 = (t.detach().double().requires_grad_() for t in (a, b, w))
    y64 = (a64 @ b64) * 2.0 + torch.bmm(a64[None], b64[None])[0] / 3.0 - F.embedding(idx, w64).sum()
    y64.sum().backward()
    torch.testing.assert_close(y.double(), y64, atol=1e-4, rtol=1e-5)
    for t, r in ((a, a64), (b, b64), (w, w64)):
        torch.testing.assert_close(t.grad.double(), r.grad, atol=1e-4, rtol=1e-5)
