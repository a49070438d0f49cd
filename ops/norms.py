"""RMSNorm and LayerNorm over the trailing `normalized_shape` dimensions, forward and backward in Triton.

One program normalises one row (held whole in a block); the backward computes the input gradient per
row and the weight (and bias) gradients as per-program partial sums over a group of rows, added up at
the end. Statistics are computed in fp32 whatever the input dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16


@triton.jit
def _norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps,
              RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        mean = 0.0
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _norm_bwd(x_ptr, w_ptr, g_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, n_cols,
              RMS: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) if HAS_W else tl.where(mask, 1.0, 0.0)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = (pid * ROWS + i).to(tl.int64)
        m = mask & ((row + cols * 0) < n_rows)  # a vector mask: the row may be past the end
        x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        # Row statistics at a clamped index: scalar masks are not portable (the interpreter rejects them),
        # and rows past the end contribute nothing through the masked x and g.
        safe = tl.minimum(row, n_rows - 1)
        mean = tl.load(mean_ptr + safe)
        rstd = tl.load(rstd_ptr + safe)
        xhat = tl.where(m, (x - mean) * rstd, 0.0)
        wg = g * w
        c1 = tl.sum(xhat * wg, axis=0) / n_cols
        if RMS:
            dx = (wg - xhat * c1) * rstd
        else:
            c2 = tl.sum(wg, axis=0) / n_cols
            dx = (wg - c2 - xhat * c1) * rstd
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
        dw += g * xhat
        db += g
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)
    tl.store(db_ptr + pid * n_cols + cols, db, mask=mask)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps, rms):
        n_cols = math.prod(normalized_shape)
        if tuple(x.shape[x.dim() - len(normalized_shape):]) != tuple(normalized_shape):
            raise ValueError(f"normalized_shape {tuple(normalized_shape)} does not end the input's shape "
                             f"{tuple(x.shape)}")
        x2 = x.contiguous().view(-1, n_cols)
        rows = x2.shape[0]
        y = torch.empty_like(x2)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        w = weight.contiguous().view(-1) if weight is not None else x2
        b = bias.contiguous().view(-1) if bias is not None else x2
        block = triton.next_power_of_2(n_cols)
        if rows:
            _norm_fwd[(rows,)](x2, w, b, y, mean, rstd, n_cols, eps, RMS=rms, HAS_W=weight is not None,
                               HAS_B=bias is not None, BLOCK=block)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.meta = (x.shape, n_cols, rms, bias is not None, bias.shape if bias is not None else None)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, weight, mean, rstd = ctx.saved_tensors
        shape, n_cols, rms, has_bias, bias_shape = ctx.meta
        g2 = g.contiguous().view(-1, n_cols)
        rows = x2.shape[0]
        programs = max(1, triton.cdiv(rows, ROWS_PER_PROGRAM))
        dx = torch.empty_like(x2)
        dw = torch.zeros((programs, n_cols), dtype=torch.float32, device=x2.device)
        db = torch.zeros((programs, n_cols), dtype=torch.float32, device=x2.device)
        w = weight.contiguous().view(-1) if weight is not None else x2
        if rows:
            _norm_bwd[(programs,)](x2, w, g2, mean, rstd, dx, dw, db, rows, n_cols, RMS=rms,
                                   HAS_W=weight is not None, ROWS=ROWS_PER_PROGRAM,
                                   BLOCK=triton.next_power_of_2(n_cols))
        gw = dw.sum(0).view(weight.shape).to(weight.dtype) if weight is not None else None
        gb = db.sum(0).view(bias_shape).to(weight.dtype if weight is not None else x2.dtype) if has_bias else None
        return dx.view(shape), None, gw, gb, None, None


def _shape(normalized_shape) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """`torch.nn.functional.rms_norm`: x / sqrt(mean(x²) + eps) * weight over the trailing dimensions."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return _Norm.apply(x, _shape(normalized_shape), weight, None, float(eps), True)


def layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """`torch.nn.functional.layer_norm`."""
    return _Norm.apply(x, _shape(normalized_shape), weight, bias, float(eps), False)
