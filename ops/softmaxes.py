"""softmax and log_softmax along any dimension, forward and backward in Triton.

The dimension is moved last. A row that fits one block is held in registers (narrow rows several to a
program); a longer row is walked in blocks, an online max and sum first, then the outputs, so rows of any
length fit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.rows import row_block
from ops.settings import row_settings


@triton.jit
def _softmax_fwd(x_ptr, y_ptr, n_rows, n_cols, LOG: tl.constexpr, WHOLE: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr):
    rows, row_mask = row_block(n_rows, ROWS)
    base = rows[:, None] * n_cols
    if WHOLE:  # the rows are in registers: one read, one write
        cols = tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
        m = tl.max(x, axis=1)
        m = tl.where(row_mask, m, 0.0)  # rows past the end are all -inf
        e = tl.exp(x - m[:, None])
        s = tl.where(row_mask, tl.sum(e, axis=1), 1.0)
        y = x - m[:, None] - tl.log(s)[:, None] if LOG else e / s[:, None]
        tl.store(y_ptr + base + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # a long row: an online max and sum, then the outputs
        m = tl.full([ROWS], -float("inf"), dtype=tl.float32)
        s = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            # Rows past the end, and blocks of -inf so far, subtract 0: no NaN from inf - inf.
            m_safe = tl.where(row_mask & (m_new != -float("inf")), m_new, 0.0)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
            m = m_new
        lse = m + tl.log(tl.where(row_mask, s, 1.0))
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = x - lse[:, None] if LOG else tl.exp(x - lse[:, None])
            tl.store(y_ptr + base + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd(y_ptr, g_ptr, dx_ptr, n_rows, n_cols, LOG: tl.constexpr, WHOLE: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows, row_mask = row_block(n_rows, ROWS)
    base = rows[:, None] * n_cols
    if WHOLE:
        cols = tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        g = tl.load(g_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = g - tl.exp(y) * tl.sum(g, axis=1)[:, None] if LOG else y * (g - tl.sum(g * y, axis=1)[:, None])
        tl.store(dx_ptr + base + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            g = tl.load(g_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if LOG:
                acc += tl.sum(g, axis=1)
            else:
                y = tl.load(y_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                acc += tl.sum(g * y, axis=1)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            g = tl.load(g_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dx = g - tl.exp(y) * acc[:, None] if LOG else y * (g - acc[:, None])
            tl.store(dx_ptr + base + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, -1).contiguous()


def _launch(kernel, n: int, numel: int, *args, log: bool) -> None:
    if numel:
        rows, block, num_warps = row_settings(n)
        n_rows = numel // n
        kernel[(triton.cdiv(n_rows, rows),)](*args, n_rows, n, LOG=log, WHOLE=block >= n, ROWS=rows, BLOCK=block,
                                             num_warps=num_warps)


def softmax_forward(x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    rows = _rows(x, dim)
    y = torch.empty(rows.shape, dtype=dtype or x.dtype, device=x.device)
    _launch(_softmax_fwd, rows.shape[-1] if rows.dim() else 1, y.numel(), rows, y, log=log)
    return y.movedim(-1, dim)


def softmax_backward(g: torch.Tensor, y: torch.Tensor, dim: int, log: bool, dtype: torch.dtype) -> torch.Tensor:
    gr, yr = _rows(g, dim), _rows(y, dim)
    dx = torch.empty(yr.shape, dtype=dtype, device=y.device)
    _launch(_softmax_bwd, yr.shape[-1] if yr.dim() else 1, dx.numel(), yr, gr, dx, log=log)
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
