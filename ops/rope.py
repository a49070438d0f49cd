"""Rotary position embedding in the "rotate half" convention (Llama's), forward and backward.

q, k: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim), or (batch, seq, head_dim) for packed rows
whose positions restart with each document. out = x*cos + rotate_half(x)*sin with
rotate_half(x) = cat(-x2, x1); the backward applies the transposed rotation. One program rotates every
head of q and k at one (batch, position), reading that position's cos and sin once; q and k are read
through their strides (the last dimension dense).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.settings import warps


@triton.jit
def _rotate(x_ptr, out_ptr, b, pos, heads, sb, ss, sh, c1, c2, s1, s2, cols, col_mask, HALF: tl.constexpr,
            HEADS: tl.constexpr, BACKWARD: tl.constexpr):
    h = tl.arange(0, HEADS)
    mask = (h < heads)[:, None] & col_mask[None, :]
    src = x_ptr + b * sb + pos * ss + h[:, None] * sh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transposed rotation
        y1 = x1 * c1[None, :] + x2 * s2[None, :]
        y2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        y1 = x1 * c1[None, :] - x2 * s1[None, :]
        y2 = x2 * c2[None, :] + x1 * s2[None, :]
    dst = out_ptr + h[:, None] * (2 * HALF) + cols[None, :]
    tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq, q_heads, k_heads, sqb, sqs, sqh, skb, sks, skh,
          cos_bstride, cos_stride, HALF: tl.constexpr, BLOCK: tl.constexpr, Q_HEADS: tl.constexpr,
          K_HEADS: tl.constexpr, BACKWARD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # one (batch, position): every head of q and k
    b = pid // seq
    pos = pid % seq
    cols = tl.arange(0, BLOCK)
    col_mask = cols < HALF
    table = b * cos_bstride + pos * cos_stride  # cos_bstride 0: one table for every row
    c1 = tl.load(cos_ptr + table + cols, mask=col_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table + cols, mask=col_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
    _rotate(q_ptr, qo_ptr + pid * q_heads * 2 * HALF, b, pos, q_heads, sqb, sqs, sqh, c1, c2, s1, s2, cols,
            col_mask, HALF, Q_HEADS, BACKWARD)
    _rotate(k_ptr, ko_ptr + pid * k_heads * 2 * HALF, b, pos, k_heads, skb, sks, skh, c1, c2, s1, s2, cols,
            col_mask, HALF, K_HEADS, BACKWARD)


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool):
    q, k = _last_dim_dense(q), _last_dim_dense(k)
    batch, seq, q_heads, dim = q.shape
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if batch * seq and dim:
        half = dim // 2
        block = triton.next_power_of_2(half)
        q_block, k_block = triton.next_power_of_2(q_heads), triton.next_power_of_2(k.shape[2])
        _rope[(batch * seq,)](q, k, cos, sin, qo, ko, seq, q_heads, k.shape[2], *q.stride()[:3], *k.stride()[:3],
                              cos.stride(0) if cos.dim() == 3 else 0, cos.stride(-2), HALF=half, BLOCK=block,
                              Q_HEADS=q_block, K_HEADS=k_block,
                              BACKWARD=backward, num_warps=warps(max(q_block, k_block) * block))
    return qo, ko


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _apply(q, k, cos, sin, False)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        dq, dk = _apply(gq, gk, cos, sin, True)  # autograd gives zeros for an unused output
        return dq, dk, None, None


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q_out, k_out): q and k rotated by position. q, k: (batch, seq, heads, head_dim); cos, sin:
    (seq, head_dim), or (batch, seq, head_dim): each row its own positions (packed documents)."""
    for name, t in (("q", q), ("k", k)):
        table = (*t.shape[:2], t.shape[-1])[3 - cos.dim():] if t.dim() == 4 else None
        if table is None or tuple(cos.shape) != table or t.shape[3] % 2:
            raise ValueError(f"{name} {tuple(t.shape)} must be (batch, seq, heads, head_dim) with an even "
                             f"head_dim and cos/sin of shape (seq, head_dim) or (batch, seq, head_dim), not "
                             f"{tuple(cos.shape)}")
    if q.shape[0] != k.shape[0] or cos.shape != sin.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share a batch size, and cos "
                         f"{tuple(cos.shape)} and sin {tuple(sin.shape)} a shape")
    return _Rope.apply(q, k, cos, sin)
