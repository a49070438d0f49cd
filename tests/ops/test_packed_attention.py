"""`kernels=triton` on packed rows (`data.packing=padding_free`): the model's boolean mask, causal within each
document, reaches our attention as document ids (trainer/models/kernels.py), and a step gives PyTorch's loss and
gradients. One small layer under Triton's interpreter (tests/ops/conftest.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import ops
from tests.ops.conftest import DEVICE
from trainer.models import kernels
from trainer.models.kernels import Kernels
from trainer.models.llama import Transformer


def _model():
    torch.manual_seed(0)
    model = Transformer(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, max_seq_len=32,
                        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False).to(DEVICE)
    model.init_buffers()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def test_packed_rows_run_in_our_attention_and_match_torch(monkeypatch):
    import ops

    torch_model = _model()
    switch = Kernels.of(SimpleNamespace(name="triton", include=None, exclude=[]))
    triton_model = switch.apply(copy.deepcopy(torch_model))
    seen = []
    launch = ops.scaled_dot_product_attention
    monkeypatch.setattr(ops, "scaled_dot_product_attention", lambda *a, **k: seen.append(k) or launch(*a, **k))
    tokens = torch.randint(0, 50, (2, 13), device=DEVICE)
    documents = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2, [0] * 13], device=DEVICE)  # three documents, one
    losses = [m(tokens[:, :-1], targets=tokens[:, 1:], documents=documents[:, :-1])
              for m in (torch_model, triton_model)]
    for loss in losses:
        loss.backward()
    # Each document numbered by where it starts: what the kernel takes, causal.
    assert len(seen) == 1 and seen[0]["is_causal"] is True
    assert seen[0]["attn_mask"].tolist() == [[0] * 5 + [5] * 6 + [11], [0] * 12]
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(torch_model.named_parameters(), triton_model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_generations_padding_mask_is_pytorchs_attention_and_other_masks_reach_the_op():
    """A decode step's boolean mask (one new query over the cache, padding masked) runs in routed ATen ops, so
    that generation (GRPO's rollout) runs under kernels=triton, grouped K/V heads included; a float mask
    reaches the op, which refuses it."""
    q, kv = torch.randn(1, 4, 4, 64, device=DEVICE), torch.randn(1, 2, 4, 64, device=DEVICE)
    decode = torch.tensor([[[[False, True, True, True]]]], device=DEVICE)  # the first key is padding
    with ops.use_kernels():
        got = kernels.attention(q[:, :, :1], kv, kv, attn_mask=decode, enable_gqa=True)
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(
        q[:, :, :1], kv, kv, attn_mask=decode, enable_gqa=True))
    with pytest.raises(ValueError, match="give document ids, an integer tensor"):
        kernels.attention(q[:, :, :1], q, q, attn_mask=torch.zeros(1, 1, 1, 4, device=DEVICE))


def test_rotary_embedding_takes_a_table_per_row():
    """Packed rows' positions restart with each document: cos/sin (batch, seq, head_dim), forward and
    backward against the model's own rotation in float64."""
    import ops
    from trainer.models.llama import apply_rotary

    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    angles = positions[..., None].double() * torch.rand(8, dtype=torch.float64)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE) for f in (torch.cos, torch.sin))
    q, k = torch.randn(2, 5, 4, 16, dtype=torch.float64), torch.randn(2, 5, 2, 16, dtype=torch.float64)
    ours = [t.float().to(DEVICE).requires_grad_() for t in (q, k)]
    ref = [t.to(DEVICE).requires_grad_() for t in (q, k)]
    out = ops.rotary_embedding(*ours, cos.float(), sin.float())
    expected = apply_rotary(*ref, cos, sin)
    grads = [torch.randn_like(t) for t in expected]
    torch.autograd.backward(out, [g.float() for g in grads])
    torch.autograd.backward(expected, grads)
    for got, want in zip([*out, *(t.grad for t in ours)], [*expected, *(t.grad for t in ref)], strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"cos/sin of shape \(seq, head_dim\) or \(batch, seq, head_dim\), not "
                                         r"\(3, 5, 16\)"):
        ops.rotary_embedding(*ours, cos[:1].expand(3, 5, 16), sin[:1].expand(3, 5, 16))
