"""Rotary position embedding in the "rotate half" convention (Llama's), forward and backward.

q, k: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim). out = x*cos + rotate_half(x)*sin with
rotate_half(x) = cat(-x2, x1); the backward applies the transposed rotation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, seq, heads, HALF: tl.constexpr, BLOCK: tl.constexpr,
          BACKWARD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (batch, position, head) vector
    pos = (row // heads) % seq
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = row * 2 * HALF
    x1 = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + pos * 2 * HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * 2 * HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(out_ptr + base + cols, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + HALF + cols, y2.to(out_ptr.dtype.element_ty), mask=mask)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    batch, seq, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        half = dim // 2
        _rope[(batch * seq * heads,)](x, cos, sin, out, seq, heads, HALF=half,
                                       BLOCK=triton.next_power_of_2(half), BACKWARD=backward)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _apply(q, cos, sin, False), _apply(k, cos, sin, False)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        dq = _apply(gq, cos, sin, True) if gq is not None else None
        dk = _apply(gk, cos, sin, True) if gk is not None else None
        return dq, dk, None, None


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q_out, k_out): q and k rotated by position. q, k: (batch, seq, heads, head_dim); cos, sin:
    (seq, head_dim)."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4 or t.shape[1] != cos.shape[0] or t.shape[3] != cos.shape[1] or t.shape[3] % 2:
            raise ValueError(f"{name} {tuple(t.shape)} must be (batch, seq, heads, head_dim) with an even "
                             f"head_dim and cos/sin of shape (seq, head_dim) = {tuple(cos.shape)}")
    return _Rope.apply(q, k, cos, sin)
