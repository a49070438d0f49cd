"""The op tests of cross entropy, and the fused linear cross entropy that never holds the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import GENERATED, _check, _leaf, dtypes


@pytest.mark.parametrize(("reduction", "smoothing"), [("mean", 0.0), ("sum", 0.1), ("none", 0.0), ("mean", 0.2)])
def test_cross_entropy(reduction, smoothing):
    logits = _leaf(11, 1037)
    target = torch.randint(0, 1037, (11,), device=DEVICE)
    target[[2, 5]] = -100
    _check(lambda a: ops.cross_entropy(a, target, reduction=reduction, label_smoothing=smoothing),
           lambda a: F.cross_entropy(a, target, reduction=reduction, label_smoothing=smoothing),
           [logits], reduced=1037)


def test_cross_entropy_with_class_dim(dtype):
    logits, target = _leaf(2, 33, 5, dtype=dtype), torch.randint(0, 33, (2, 5), device=DEVICE)
    _check(lambda a: ops.cross_entropy(a, target), lambda a: F.cross_entropy(a, target), [logits], reduced=33,
           dtype=dtype)


@pytest.mark.timeout(300)
@GENERATED
@given(rows=st.integers(1, 20), vocab=st.one_of(st.integers(1, 100), st.integers(8000, 9000)), dtype=dtypes,
       reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.1]),
       ignored=st.integers(0, 3))
def test_cross_entropy_generated(rows, vocab, dtype, reduction, smoothing, ignored):
    logits = _leaf(rows, vocab, dtype=dtype, scale=3.0)
    target = torch.randint(0, vocab, (rows,), device=DEVICE)
    target[: min(ignored, rows - 1)] = -100
    _check(lambda a: ops.cross_entropy(a, target, reduction=reduction, label_smoothing=smoothing),
           lambda a: F.cross_entropy(a, target, reduction=reduction, label_smoothing=smoothing),
           [logits], reduced=vocab, dtype=dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_linear_cross_entropy(bias, reduction):
    _check_fused(2 * 13, 24, 259, bias, reduction, 7, torch.float32)


def _check_fused(rows, hidden_size, vocab, bias, reduction, chunk_rows, dtype):
    hidden, weight = _leaf(rows, hidden_size, dtype=dtype), _leaf(vocab, hidden_size, dtype=dtype, scale=0.5)
    b = _leaf(vocab, dtype=dtype) if bias else None
    target = torch.randint(0, vocab, (rows,), device=DEVICE)
    target[: min(3, rows - 1)] = -100
    inputs = [hidden, weight] + ([b] if bias else [])

    def ours(h, w, *bb):
        return ops.fused_linear_cross_entropy(h, w, target, *bb, reduction=reduction, chunk_rows=chunk_rows)

    def ref(h, w, *bb):
        return F.cross_entropy(F.linear(h, w, *bb), target, reduction=reduction)

    # A 16-bit weight gradient is accumulated in its dtype, chunk by chunk: allow one rounding per chunk.
    reduced = vocab * (1 if dtype == torch.float32 else 1 + rows // (chunk_rows or rows))
    _check(ours, ref, inputs, reduced=reduced, dtype=dtype, grad=torch.tensor(0.7, dtype=torch.float64))


@pytest.mark.timeout(300)
@GENERATED
@given(rows=st.integers(1, 30), hidden_size=st.integers(1, 40), vocab=st.integers(2, 300), bias=st.booleans(),
       reduction=st.sampled_from(["mean", "sum"]), chunk_rows=st.sampled_from([None, 1, 5, 64]),
       dtype=st.sampled_from([torch.float32]))
def test_fused_linear_cross_entropy_generated(rows, hidden_size, vocab, bias, reduction, chunk_rows, dtype):
    _check_fused(rows, hidden_size, vocab, bias, reduction, chunk_rows, dtype)


def test_fused_linear_cross_entropy_refuses_a_second_backward():
    h, w = _leaf(4, 8), _leaf(16, 8)
    loss = ops.fused_linear_cross_entropy(h, w, torch.randint(0, 16, (4,), device=DEVICE))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="computes its gradients once"):
        loss.backward()
    with pytest.raises(ValueError, match="chunk_rows=0"):
        ops.fused_linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long, device=DEVICE), chunk_rows=0)


def test_fused_linear_cross_entropy_under_autocast():
    """The trainer's bf16 autocast hands fp32 hidden states and weights: the fused op computes as F.linear
    would under autocast (bf16 matmuls) and gives fp32-typed gradients, like eager."""
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    hidden, weight = _leaf(37, 24), _leaf(259, 24, scale=0.5)
    target = torch.randint(0, 259, (37,), device=DEVICE)
    results = []
    for fn in (lambda h, w: ops.fused_linear_cross_entropy(h, w, target, chunk_rows=16),
               lambda h, w: F.cross_entropy(F.linear(h, w), target)):
        hidden.grad = weight.grad = None
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = fn(hidden, weight)
        loss.backward()
        results.append((loss.float(), hidden.grad.clone(), weight.grad.clone()))
    (ours, gh, gw), (eager, eh, ew) = results
    assert ours.dtype == eager.dtype == torch.float32 and gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(ours, eager, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(gh, eh, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(gw, ew, atol=2e-2, rtol=1.6e-2)
