"""The op tests of scaled dot-product attention: causal, grouped-query, packed documents, model layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import _leaf, dtypes


def _attention_reference(q, k, v, documents=None, is_causal=False, scale=None):
    """PyTorch's attention with the K/V heads repeated per group and both masks as one boolean matrix."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    if is_causal:
        mask = mask.tril()
    if documents is not None:
        mask = mask & (documents[:, :, None] == documents[:, None, :])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _documents(batch, seq, count):
    """Packed rows: document ids that never decrease along a row, `count` documents at most."""
    return torch.sort(torch.randint(0, count, (batch, seq)), dim=1).values.to(DEVICE)


def _check_attention(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, causal=False, documents=None,
                     model_layout=False, scale=None):
    """Ours against the float64 reference, forward and the three input gradients. With `model_layout` the
    inputs are (batch, seq, heads, dim) tensors seen transposed, as the model hands them over.

    fp32 within the op tests' tolerance. In 16 bits, FlashAttention's own bar: the largest error at most
    twice that of PyTorch's attention in the same dtype, plus one rounding at the tensor's scale (the
    probabilities meet V and dS meets K and Q as 16-bit tiles, so errors grow with the sums, not with
    each element)."""
    def leaf(h, s):
        return _leaf(batch, s, h, head_dim, dtype=dtype) if model_layout else _leaf(batch, h, s, head_dim, dtype=dtype)

    def run(fn, tensors, grad):
        views = [t.transpose(1, 2) if model_layout else t for t in tensors]
        out = fn(*views, documents=documents, is_causal=causal, scale=scale)
        out.backward(grad.to(out.dtype))
        return [out.detach().double()] + [t.grad.double() for t in tensors]

    def ours(q, k, v, documents, is_causal, scale):
        return ops.scaled_dot_product_attention(q, k, v, attn_mask=documents, is_causal=is_causal, scale=scale,
                                                enable_gqa=True)

    inputs = [leaf(heads, seq_q), leaf(kv_heads, seq_k), leaf(kv_heads, seq_k)]
    grad = torch.randn(batch, heads, seq_q, head_dim, dtype=torch.float64, device=DEVICE)
    expected = run(_attention_reference, [t.detach().double().requires_grad_() for t in inputs], grad)
    got = run(ours, inputs, grad)
    if dtype == torch.float32:
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1.3e-6)
        return
    eager = run(_attention_reference, [t.detach().clone().requires_grad_() for t in inputs], grad)
    eps = torch.finfo(dtype).eps
    for name, g, e, p in zip(("output", "dq", "dk", "dv"), got, expected, eager, strict=True):
        error, allowed = (g - e).abs().max().item(), 2 * (p - e).abs().max().item() + eps * e.abs().max().item()
        assert error <= allowed, f"{name}: off by {error:.3g}, allowed {allowed:.3g} (twice eager's, one rounding)"


@pytest.mark.parametrize(("shape", "causal", "packed", "model_layout"), [
    ((2, 4, 2, 37, 37, 64), True, False, True),    # grouped heads, the model's layout, causal
    ((1, 2, 1, 20, 20, 80), False, True, False),   # documents, not causal; 80 padded to 128
    ((1, 2, 2, 70, 70, 96), True, True, True),     # causal within each document, several blocks
    ((1, 2, 1, 29, 5, 128), True, False, False),   # causal, more queries than keys (top-left aligned)
], ids=["gqa-causal", "documents-hd80", "packed-hd96", "causal-rect-hd128"])
def test_scaled_dot_product_attention(shape, causal, packed, model_layout, dtype):
    batch, _, _, seq, _, _ = shape
    documents = _documents(batch, seq, 3) if packed else None
    _check_attention(*shape, dtype, causal=causal, documents=documents, model_layout=model_layout)


@pytest.mark.timeout(300)
@settings(max_examples=8, deadline=None, derandomize=True)
@given(kv_heads=st.integers(1, 2), group=st.integers(1, 3), seq_q=st.integers(1, 48), seq_k=st.integers(1, 48),
       head_dim=st.sampled_from([64, 80, 96, 128]), dtype=dtypes, causal=st.booleans(), packed=st.integers(0, 4),
       model_layout=st.booleans(), scale=st.sampled_from([None, 0.3]))
def test_scaled_dot_product_attention_generated(kv_heads, group, seq_q, seq_k, head_dim, dtype, causal, packed,
                                                model_layout, scale):
    torch.manual_seed(seq_q * 100 + seq_k)  # the same values each time hypothesis replays a case
    documents = None
    if packed:  # document ids describe one sequence: as many keys as queries
        seq_k = seq_q
        documents = _documents(1, seq_q, packed)
    _check_attention(1, kv_heads * group, kv_heads, seq_q, seq_k, head_dim, dtype, causal=causal, documents=documents,
                     model_layout=model_layout, scale=scale)


def test_attention_holds_no_seq_by_seq_matrix_and_its_gradients_are_deterministic():
    """Every tensor the forward and backward allocate is at most as large as q (in bytes: the interpreter
    sees tensors as bytes too): no (seq, seq) scores, not even one head's; and
    the K/V gradients of grouped heads, summed in one program each, are the same bits run after run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.bytes = max(self.bytes, t.numel() * t.element_size())
            return out

    q, k, v = _leaf(1, 2, 160, 64), _leaf(1, 1, 160, 64), _leaf(1, 1, 160, 64)
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        largest = Largest()
        with largest:
            out = ops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(torch.ones_like(out))
        assert largest.bytes <= q.numel() * 4 < 160 * 160 * 4
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_attention_refuses_what_it_does_not_take():
    q, k = torch.zeros(1, 4, 8, 64, device=DEVICE), torch.zeros(1, 2, 8, 64, device=DEVICE)
    sdpa = ops.scaled_dot_product_attention
    with pytest.raises(ValueError, match="give document ids, an integer tensor"):
        sdpa(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="need enable_gqa=True"):
        sdpa(q, k, k)
    with pytest.raises(ValueError, match="not a multiple of 3 key/value heads"):
        sdpa(q, q[:, :3], q[:, :3], enable_gqa=True)
    with pytest.raises(ValueError, match="dropout_p=0.1"):
        sdpa(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"document ids need \(batch, seq\) = \(1, 8\)"):
        sdpa(q, q, q, attn_mask=torch.zeros(1, 7, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="head_dim 320: at most 256"):
        z = torch.zeros(1, 1, 2, 320, device=DEVICE)
        sdpa(z, z, z)
