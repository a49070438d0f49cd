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


def test_calls_the_kernels_do_not_compute_are_pytorchs():
    """A call in a dtype the op's row of `python -m ops list` does not name, or with an argument its kernel
    does not take, is declined to PyTorch's kernel: same result and dtype, or the same refusal."""
    from ops.aten import declined

    a, b = torch.arange(6, device=DEVICE).view(2, 3), torch.arange(6, device=DEVICE).view(3, 2)
    c = torch.ones(1, 2, 2, dtype=torch.int64, device=DEVICE)
    calls_ = [lambda: torch.mm(a, b), lambda: torch.bmm(a[None], b[None]), lambda: torch.addmm(c[0], a, b),
              lambda: torch.baddbmm(c, a[None], b[None]), lambda: torch.mv(a, b[:, 0]),
              lambda: torch.nn.functional.hardtanh(torch.arange(-3, 4, device=DEVICE)),
              lambda: torch.randn(5, dtype=torch.float64, device=DEVICE).exp(),
              lambda: torch.zeros(3, dtype=torch.bool, device=DEVICE).index_add(
                  0, torch.tensor([0, 2], device=DEVICE), torch.ones(2, dtype=torch.bool, device=DEVICE))]
    for call in calls_:
        torch.manual_seed(0)
        expected = call()
        before = sum(declined.values())
        with ops.use_kernels():
            torch.manual_seed(0)
            got = call()
        assert sum(declined.values()) > before
        assert got.dtype == expected.dtype and torch.equal(got, expected), (got, expected)
    with ops.use_kernels(), pytest.raises(RuntimeError, match="can't be cast"):
        torch.arange(3, device=DEVICE).logit_()


def test_gather_and_scatter_take_an_index_smaller_than_the_tensor():
    x = torch.randn(4, 5, device=DEVICE)
    index = torch.tensor([[0, 3], [2, 1], [-1, 0]], device=DEVICE) % 4
    src = torch.randn(3, 3, device=DEVICE)
    with ops.use_kernels(include=["gather", "scatter", "scatter_add"]):
        got = (x.gather(0, index), x.scatter(0, index, src), x.scatter_add(0, index, src), x.scatter(1, index, 2.5))
    expected = (x.gather(0, index), x.scatter(0, index, src), x.scatter_add(0, index, src), x.scatter(1, index, 2.5))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_layer_norm_statistics_keep_pytorchs_dtype_on_this_device():
    x = torch.randn(2, 8, device=DEVICE, dtype=torch.float16)
    expected = torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5)
    with ops.use_kernels(include=["native_layer_norm"]):
        got = torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5)
    assert [t.dtype for t in got] == [t.dtype for t in expected]
