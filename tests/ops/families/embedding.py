"""The op tests of the embedding lookup and its gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import _check, _leaf


@pytest.mark.parametrize(("padding_idx", "scale_grad_by_freq"), [(None, False), (3, True)])
def test_embedding(padding_idx, scale_grad_by_freq, dtype):
    weight = _leaf(11, 37, dtype=dtype)
    indices = torch.randint(0, 11, (4, 9), device=DEVICE)
    indices[0, :4] = 3  # repeated, and the padding index

    def ours(w):
        return ops.embedding(indices, w, padding_idx, scale_grad_by_freq)

    def ref(w):
        return F.embedding(indices, w, padding_idx, scale_grad_by_freq=scale_grad_by_freq)

    _check(ours, ref, [weight], reduced=36, dtype=dtype)
    grads = []
    for _ in range(2):  # the same bits each time: each row is summed by one program, in order
        weight.grad = None
        ours(weight).backward(torch.ones(4, 9, 37, dtype=dtype, device=DEVICE))
        grads.append(weight.grad.clone())
    assert torch.equal(*grads)
    with pytest.raises(ValueError, match="indices are torch.float32: give an integer tensor"):
        ops.embedding(indices.float(), weight)
