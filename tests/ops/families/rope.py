"""The op tests of rotary position embeddings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import GENERATED, _check, _leaf, dtypes


def test_rotary_embedding(dtype):
    q, k = _leaf(2, 7, 3, 12, dtype=dtype), _leaf(2, 7, 1, 12, dtype=dtype)
    _check_rope(q, k, dtype)


def _check_rope(q, k, dtype):
    from trainer.models.llama import apply_rotary  # the model's eager reference

    seq, dim = q.shape[1], q.shape[3]
    angles = torch.outer(torch.arange(float(seq)), torch.rand(dim // 2)).to(DEVICE)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def ours(a, b):
        qo, ko = ops.rotary_embedding(a, b, cos, sin)
        return torch.cat([qo.flatten(), ko.flatten()])

    def ref(a, b):
        qo, ko = apply_rotary(a, b, cos.double(), sin.double())
        return torch.cat([qo.flatten(), ko.flatten()])

    _check(ours, ref, [q, k], dtype=dtype)


@pytest.mark.timeout(300)
@GENERATED
@given(batch=st.integers(1, 3), seq=st.integers(1, 9), q_heads=st.integers(1, 6), k_heads=st.integers(1, 3),
       half=st.integers(1, 40), dtype=dtypes, strided=st.booleans())
def test_rotary_embedding_generated(batch, seq, q_heads, k_heads, half, dtype, strided):
    q = _leaf(batch, seq, q_heads, 2 * half, dtype=dtype)
    if strided:  # (batch, heads, seq, dim) transposed to (batch, seq, heads, dim), as attention code does
        q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    _check_rope(q, _leaf(batch, seq, k_heads, 2 * half, dtype=dtype), dtype)
