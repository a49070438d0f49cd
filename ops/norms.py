"""RMSNorm and LayerNorm over the trailing `normalized_shape` dimensions, forward and backward in Triton.

A row that fits one block is held in registers, and narrow rows are taken several at a time (a 2-D
block); longer rows are walked in blocks, in passes. The forward writes each row's mean and 1/std; the
backward runs one program per share of the device (Liger-Kernel's layout): each walks its rows, writes
their input gradients and keeps the weight and bias gradients as a partial sum, and the partial sums are
added at the end. Statistics and sums are fp32 whatever the input dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ops.rows import row_block
from ops.settings import programs, row_settings


@triton.jit
def _norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, eps, RMS: tl.constexpr,
              HAS_W: tl.constexpr, HAS_B: tl.constexpr, WHOLE: tl.constexpr, ROWS: tl.constexpr,
              BLOCK: tl.constexpr):
    rows, row_mask = row_block(n_rows, ROWS)
    base = rows[:, None] * n_cols
    if WHOLE:  # the row is in registers: one read, one write
        cols = tl.arange(0, BLOCK)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if RMS:
            mean = tl.zeros([ROWS], dtype=tl.float32)
            xc = x
        else:
            mean = tl.sum(x, axis=1) / n_cols
            xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + base + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # a long row: the mean, then the variance about it, then the output
        mean = tl.zeros([ROWS], dtype=tl.float32)
        if not RMS:
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                mean += tl.sum(tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32), axis=1)
            mean = mean / n_cols
        sq = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            sq += tl.sum(xc * xc, axis=1)
        rstd = tl.math.rsqrt(sq / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_B:
                y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + base + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _norm_bwd(x_ptr, w_ptr, g_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, n_cols,
              RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, WHOLE: tl.constexpr,
              ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    partial = pid.to(tl.int64) * n_cols  # this program's row of the partial weight/bias gradients
    if WHOLE:
        cols = tl.arange(0, BLOCK)
        col_mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) if HAS_W else tl.where(col_mask, 1.0, 0.0)
        dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        db = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for tile in range(pid, n_tiles, tl.num_programs(0)):
            rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            offs = rows[:, None] * n_cols + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            wg = g * w[None, :]
            c1 = tl.sum(xhat * wg, axis=1) / n_cols
            if RMS:
                dx = (wg - xhat * c1[:, None]) * rstd[:, None]
            else:
                c2 = tl.sum(wg, axis=1) / n_cols
                dx = (wg - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_W:
                dw += g * xhat
            if HAS_B:
                db += g
        if HAS_W:
            tl.store(dw_ptr + partial + cols, tl.sum(dw, axis=0), mask=col_mask)
        if HAS_B:
            tl.store(db_ptr + partial + cols, tl.sum(db, axis=0), mask=col_mask)
    else:  # long rows, one at a time: the row's sums, then its gradients
        for tile in range(pid, n_tiles, tl.num_programs(0)):
            rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            row_mask = rows < n_rows
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            c1 = tl.zeros([ROWS], dtype=tl.float32)
            c2 = tl.zeros([ROWS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                offs = rows[:, None] * n_cols + cols[None, :]
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    g = g * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
                c1 += tl.sum(xhat * g, axis=1)
                c2 += tl.sum(g, axis=1)
            c1 = c1 / n_cols
            c2 = c2 / n_cols
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                offs = rows[:, None] * n_cols + cols[None, :]
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                wg = g * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] if HAS_W else g
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
                if RMS:
                    dx = (wg - xhat * c1[:, None]) * rstd[:, None]
                else:
                    dx = (wg - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
                tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if HAS_W:
                    dw = tl.load(dw_ptr + partial + cols, mask=col_mask, other=0.0)
                    tl.store(dw_ptr + partial + cols, dw + tl.sum(g * xhat, axis=0), mask=col_mask)
                if HAS_B:
                    db = tl.load(db_ptr + partial + cols, mask=col_mask, other=0.0)
                    tl.store(db_ptr + partial + cols, db + tl.sum(g, axis=0), mask=col_mask)


def norm_forward(x, normalized_shape, weight, bias, eps, rms):
    """(y, mean, rstd, x as rows): the forward kernel over the trailing `normalized_shape` dimensions."""
    n_cols = math.prod(normalized_shape)
    if tuple(x.shape[x.dim() - len(normalized_shape):]) != tuple(normalized_shape):
        raise ValueError(f"normalized_shape {tuple(normalized_shape)} does not end the input's shape "
                         f"{tuple(x.shape)}")
    x2 = x.contiguous().view(-1, n_cols)
    n_rows = x2.shape[0]
    y = torch.empty_like(x2)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    w = weight.contiguous().view(-1) if weight is not None else x2
    b = bias.contiguous().view(-1) if bias is not None else x2
    rows, block, num_warps = row_settings(n_cols)
    if n_rows and n_cols:
        _norm_fwd[(triton.cdiv(n_rows, rows),)](
            x2, w, b, y, mean, rstd, n_rows, n_cols, eps, RMS=rms, HAS_W=weight is not None,
            HAS_B=bias is not None, WHOLE=block >= n_cols, ROWS=rows, BLOCK=block, num_warps=num_warps)
    return y.view(x.shape), mean, rstd, x2


def norm_backward(g, x2, weight, bias, mean, rstd, rms):
    """(dx as rows, dweight, dbias) from the saved rows, mean and rstd."""
    n_rows, n_cols = x2.shape
    g2 = g.contiguous().view(-1, n_cols)
    rows, block, num_warps = row_settings(n_cols)
    grid = max(1, min(programs(x2.device), triton.cdiv(n_rows, rows)))
    dx = torch.empty_like(x2)
    # Partial sums per program; the long-row path adds into them, so they start at zero.
    dw = torch.zeros((grid, n_cols), dtype=torch.float32, device=x2.device) if weight is not None else None
    db = torch.zeros((grid, n_cols), dtype=torch.float32, device=x2.device) if bias is not None else None
    if n_rows and n_cols:
        _norm_bwd[(grid,)](x2, weight.contiguous().view(-1) if weight is not None else x2, g2, mean, rstd, dx,
                           dw if dw is not None else x2, db if db is not None else x2, n_rows, n_cols,
                           RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None, WHOLE=block >= n_cols,
                           ROWS=rows, BLOCK=block, num_warps=num_warps)
    gw = dw.sum(0).view(weight.shape).to(weight.dtype) if weight is not None else None
    gb = db.sum(0).view(bias.shape).to(bias.dtype) if bias is not None else None
    return dx, gw, gb


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps, rms):
        y, mean, rstd, x2 = norm_forward(x, normalized_shape, weight, bias, eps, rms)
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.meta = (x.shape, rms)
        return y

    @staticmethod
    def backward(ctx, g):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        shape, rms = ctx.meta
        dx, gw, gb = norm_backward(g, x2, weight, bias, mean, rstd, rms)
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


def _stats_shape(x, normalized_shape):
    return (*x.shape[:x.dim() - len(normalized_shape)], *([1] * len(normalized_shape)))


def _native_layer_norm(input, normalized_shape, weight, bias, eps):
    y, mean, rstd, _ = norm_forward(input, _shape(normalized_shape), weight, bias, float(eps), False)
    # PyTorch's own: a GPU keeps a 16-bit input's statistics in fp32, the CPU in the input's dtype.
    stats = torch.float32 if input.is_cuda and input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    shape = _stats_shape(input, _shape(normalized_shape))
    return y, mean.to(stats).view(shape), rstd.to(stats).view(shape)


def _native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    n_cols = math.prod(_shape(normalized_shape))
    x2 = input.contiguous().view(-1, n_cols)
    dx, gw, gb = norm_backward(grad_out, x2, weight, bias, mean.reshape(-1).float(), rstd.reshape(-1).float(),
                               False)
    return (dx.view(input.shape) if output_mask[0] else None, gw if output_mask[1] else None,
            gb if output_mask[2] else None)


def _fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    y, _, rstd, _ = norm_forward(input, _shape(normalized_shape), weight, None, float(eps), True)
    return y, rstd.view(_stats_shape(input, _shape(normalized_shape)))


def _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    n_cols = math.prod(_shape(normalized_shape))
    x2 = input.contiguous().view(-1, n_cols)
    mean = torch.zeros_like(rstd.reshape(-1), dtype=torch.float32)
    dx, gw, _ = norm_backward(grad_out, x2, weight, None, mean, rstd.reshape(-1).float(), True)
    return dx.view(input.shape) if output_mask[0] else None, gw if output_mask[1] else None


@triton.jit
def _group_affine(x, mean, rstd, w, b):
    return (x - mean) * rstd * w + b


@triton.jit
def _group_xhat_grad(g, x, mean, rstd):
    return g * (x - mean) * rstd


def _group_ops():
    from ops.pointwise_codegen import pointwise

    return pointwise()(_group_affine), pointwise(promote="float")(_group_xhat_grad)


def _native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    """GroupNorm: the statistics of each (sample, group) row by the LayerNorm kernel, then one pointwise pass
    (x - mean) * rstd * weight[c] + bias[c] from the input and the fp32 statistics."""
    rows = input.reshape(N * group, (C // group) * HxW) if N * group else input.reshape(0, max(1, C // group * HxW))
    y, mean, rstd, _ = norm_forward(rows, (rows.shape[1],), None, None, float(eps), False)
    if weight is not None or bias is not None:
        affine, _ = _group_ops()
        shape = (N, group, C // group, HxW)
        w = weight.reshape(1, group, C // group, 1) if weight is not None else 1.0
        b = bias.reshape(1, group, C // group, 1) if bias is not None else 0.0
        y = affine(input.reshape(shape), mean.view(N, group, 1, 1), rstd.view(N, group, 1, 1), w, b,
                   out=torch.empty(shape, dtype=input.dtype, device=input.device))
    return y.view(input.shape), mean.to(input.dtype).view(N, group), rstd.to(input.dtype).view(N, group)


def _native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    """dx by the LayerNorm backward kernel on each (sample, group) row of grad * weight[c]; the weight and bias
    gradients as sums over samples and positions (fp32) of grad * x̂ and grad."""
    from ops import reductions
    from ops.pointwise_ops import OPS

    shape = (N, group, C // group, HxW)
    g4, x4 = grad_out.reshape(shape), input.reshape(shape)
    m4, r4 = mean.float().reshape(N, group, 1, 1), rstd.float().reshape(N, group, 1, 1)
    dx = dw = db = None
    if output_mask[0]:
        g = OPS["mul"](g4, weight.float().reshape(1, group, C // group, 1)) if weight is not None else g4
        rows = input.reshape(N * group, -1) if N * group else input.reshape(0, 1)
        dx = norm_backward(g, rows, None, None, m4.reshape(-1), r4.reshape(-1), False)[0].view(input.shape)
    if output_mask[1] and weight is not None:
        _, xhat_grad = _group_ops()
        dw = reductions.reduce(xhat_grad(g4, x4, m4, r4), [0, 3], False, "sum", torch.float32)
        dw = dw.reshape(C).to(weight.dtype)
    if output_mask[2]:
        db = reductions.reduce(g4, [0, 3], False, "sum", torch.float32).reshape(C).to(grad_out.dtype)
    return dx, dw, db


# On CPU, `rms_norm` is decomposed by PyTorch before any backend (into pow, mean, rsqrt, mul: all routed);
# on CUDA it reaches `_fused_rms_norm`.
ATEN = {
    "native_layer_norm": _native_layer_norm,
    "native_layer_norm_backward": _native_layer_norm_backward,
    "_fused_rms_norm": _fused_rms_norm,
    "_fused_rms_norm_backward": _fused_rms_norm_backward,
    "native_group_norm": _native_group_norm,
    "native_group_norm_backward": _native_group_norm_backward,
}
