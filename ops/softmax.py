"""softmax and log_softmax along any dimension, forward and backward in Triton.

The dimension is moved last; one program handles one row in blocks (an online max and sum first, then
the outputs), so rows of any length fit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_MAX = 1024


@triton.jit
def _softmax_fwd(x_ptr, y_ptr, n_cols, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        y = x - lse if LOG else tl.exp(x - lse)
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd(y_ptr, g_ptr, dx_ptr, n_cols, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(g_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            acc += tl.sum(g, axis=0)
        else:
            acc += tl.sum(g * tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32), axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(g_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dx = g - tl.exp(y) * acc if LOG else y * (g - acc)
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, -1).contiguous()


def softmax_forward(x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    rows = _rows(x, dim)
    y = torch.empty(rows.shape, dtype=dtype or x.dtype, device=x.device)
    n = rows.shape[-1] if rows.dim() else 1
    if y.numel():
        _softmax_fwd[(y.numel() // n,)](rows, y, n, LOG=log, BLOCK=min(BLOCK_MAX, triton.next_power_of_2(n)))
    return y.movedim(-1, dim)


def softmax_backward(g: torch.Tensor, y: torch.Tensor, dim: int, log: bool, dtype: torch.dtype) -> torch.Tensor:
    gr, yr = _rows(g, dim), _rows(y, dim)
    dx = torch.empty(yr.shape, dtype=dtype, device=y.device)
    n = yr.shape[-1] if yr.dim() else 1
    if dx.numel():
        _softmax_bwd[(dx.numel() // n,)](yr, gr, dx, n, LOG=log, BLOCK=min(BLOCK_MAX, triton.next_power_of_2(n)))
    return dx.movedim(-1, dim)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, log):
        y = softmax_forward(x, dim, log)
        ctx.save_for_backward(y)
        ctx.args = (dim, log, x.dtype)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        dim, log, dtype = ctx.args
        return softmax_backward(g, y, dim, log, dtype), None, None


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _Softmax.apply(x, dim % max(x.dim(), 1), False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _Softmax.apply(x, dim % max(x.dim(), 1), True)
