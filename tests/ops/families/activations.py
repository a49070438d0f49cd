"""The op tests of SiLU, GELU and the gated activations (SwiGLU's silu_and_mul and the rest), forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import ops
from tests.ops.families.common import GENERATED, _check, _leaf, dtypes


def test_activations(dtype):
    x, y = _leaf(3, 37, 5, dtype=dtype, transpose=True), _leaf(3, 37, 5, dtype=dtype)
    _check(ops.silu, F.silu, [x], dtype=dtype)
    _check(lambda a: ops.gelu(a), lambda a: F.gelu(a), [_leaf(7, 33, dtype=dtype)], dtype=dtype)
    _check(lambda a: ops.gelu(a, "tanh"), lambda a: F.gelu(a, approximate="tanh"), [_leaf(7, 33, dtype=dtype)],
           dtype=dtype)
    _check(ops.silu_and_mul, lambda a, b: F.silu(a) * b, [x, y], dtype=dtype)
    _check(ops.gelu_and_mul, lambda a, b: F.gelu(a) * b, [_leaf(5, 19, dtype=dtype), _leaf(5, 19, dtype=dtype)],
           dtype=dtype)
    _check(lambda a, b: ops.gelu_and_mul(a, b, "tanh"), lambda a, b: F.gelu(a, approximate="tanh") * b,
           [_leaf(5, 19, dtype=dtype), _leaf(5, 19, dtype=dtype)], dtype=dtype)


ACTIVATIONS = {
    "silu": (ops.silu, F.silu),
    "gelu": (ops.gelu, F.gelu),
    "gelu_tanh": (lambda a: ops.gelu(a, "tanh"), lambda a: F.gelu(a, approximate="tanh")),
    "silu_and_mul": (ops.silu_and_mul, lambda a, b: F.silu(a) * b),
    "gelu_and_mul": (ops.gelu_and_mul, lambda a, b: F.gelu(a) * b),
}


@pytest.mark.timeout(300)
@GENERATED
@given(name=st.sampled_from(sorted(ACTIVATIONS)), shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       dtype=dtypes, transpose=st.booleans())
def test_activations_generated(name, shape, dtype, transpose):
    ours, ref = ACTIVATIONS[name]
    inputs = [_leaf(*shape, dtype=dtype, transpose=transpose, scale=3.0), _leaf(*shape, dtype=dtype)]
    _check(ours, ref, inputs[: 2 if name.endswith("_and_mul") else 1], dtype=dtype)


def test_gated_backward_is_one_launch(monkeypatch):
    import sys

    module = sys.modules["ops.pointwise_codegen"]
    launches = []

    def counted(launch):
        def run(fn, *rest):
            launches.append(getattr(fn, "fn", fn).__name__)
            return launch(fn, *rest)

        return run

    for name in ("_launch", "_launch_flat"):
        monkeypatch.setattr(module, name, counted(getattr(module, name)))
    x, y = _leaf(4, 6), _leaf(4, 6)
    out = ops.silu_and_mul(x, y)
    launches.clear()
    out.backward(torch.ones_like(out))
    assert launches == ["silu_mul_bwd"]
    torch.testing.assert_close(y.grad, F.silu(x.detach()))
