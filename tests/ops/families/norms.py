"""The op tests of RMSNorm and LayerNorm."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import ops
from tests.ops.families.common import GENERATED, _check, _leaf, dtypes


def test_rms_norm(dtype):
    for weighted in (True, False):
        x = _leaf(4, 9, 24, dtype=dtype, transpose=True)
        w = _leaf(24, dtype=dtype) if weighted else None
        inputs = [x, w] if weighted else [x]
        _check(lambda a, *b: ops.rms_norm(a, (24,), *b, eps=1e-6), lambda a, *b: F.rms_norm(a, (24,), *b, eps=1e-6),
               inputs, reduced=24, dtype=dtype)


def test_layer_norm_over_two_dims():
    x, w, b = _leaf(6, 5, 3, 7), _leaf(3, 7), _leaf(3, 7)
    _check(lambda a, c, d: ops.layer_norm(a, (3, 7), c, d), lambda a, c, d: F.layer_norm(a, (3, 7), c, d),
           [x, w, b], reduced=21 * 6 * 5)


@pytest.mark.timeout(300)
@GENERATED
@given(rows=st.integers(1, 40), cols=st.one_of(st.integers(1, 300), st.integers(8000, 9000)), dtype=dtypes,
       rms=st.booleans(), weight=st.booleans(), bias=st.booleans(), eps=st.sampled_from([1e-5, 1e-6, 0.1]))
def test_norms_generated(rows, cols, dtype, rms, weight, bias, eps):
    x = _leaf(rows, cols, dtype=dtype, scale=2.0)
    w = _leaf(cols, dtype=dtype) if weight else None
    b = _leaf(cols, dtype=dtype) if bias and not rms else None
    inputs = [t for t in (x, w, b) if t is not None]

    def call(fn, a, *rest):
        it = iter(rest)
        wt, bt = (next(it) if weight else None), (next(it) if b is not None else None)
        if rms:
            return fn[0](a, (cols,), wt, eps=eps)
        return fn[1](a, (cols,), wt, bt, eps=eps)

    _check(lambda *t: call((ops.rms_norm, ops.layer_norm), *t), lambda *t: call((F.rms_norm, F.layer_norm), *t),
           inputs, reduced=rows * cols, dtype=dtype)
