"""sum over any dimensions, in Triton: the reduced dimensions are moved last (a copy only when they are not
already the innermost), so each program sums a block of rows in fp32 (int64 for integers, exactly).

`ops.sum(x, dim=None, keepdim=False, dtype=None)` follows `torch.sum`'s result dtype (integers and bools
sum to int64); `ops.enable()` routes `sum` and `sum.dim_IntList` here. Its backward is an expand, which
PyTorch's own formula does without a kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.settings import row_settings


@triton.jit(do_not_specialize=["n_rows", "n_cols"])
def _row_sum(x_ptr, y_ptr, n_rows, n_cols, COMPUTE: tl.constexpr, SQUARES: tl.constexpr, ROWS: tl.constexpr,
             BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    acc = tl.zeros([ROWS, BLOCK], dtype=COMPUTE)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(COMPUTE)
        if SQUARES:
            x = x * x
        acc += x
    total = tl.sum(acc, axis=1)
    if SQUARES:  # a 2-norm: the root of the sum of squares
        total = tl.sqrt(total)
    tl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=row_mask)


def _dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(x.dim(), 1) for d in dims})


class _Sum(torch.autograd.Function):
    """The gradient of a sum is the incoming gradient expanded back over the summed dimensions: a view."""

    @staticmethod
    def forward(ctx, x, dim, keepdim, dtype):
        ctx.shape, ctx.dims, ctx.dtype = x.shape, _dims(x, dim), x.dtype
        return _sum(x, dim, keepdim, dtype)

    @staticmethod
    def backward(ctx, g):
        kept = [1 if d in ctx.dims else size for d, size in enumerate(ctx.shape)]
        return g.reshape(kept).expand(ctx.shape).to(ctx.dtype), None, None, None


def sum(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.sum`: over `dim` (an int, a list, or None/[] for every dimension), differentiable."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Sum.apply(x, dim, keepdim, dtype)
    return _sum(x, dim, keepdim, dtype)


def _sum(x: torch.Tensor, dim, keepdim: bool, dtype: torch.dtype | None, squares: bool = False) -> torch.Tensor:
    """The sum over `dim`; with `squares`, the 2-norm (the root of the sum of squares, floats only)."""
    if dtype is None:
        dtype = torch.int64 if not (x.is_floating_point() or x.is_complex()) else x.dtype
    if x.is_complex() or dtype.is_complex:
        raise ValueError(f"sum of {x.dtype} into {dtype}: the kernel sums real numbers")
    dims = _dims(x, dim)
    kept = [d for d in range(x.dim()) if d not in dims]
    out_shape = [1 if d in dims else x.shape[d] for d in range(x.dim())] if keepdim else [x.shape[d] for d in kept]
    n_rows = 1
    for d in kept:
        n_rows *= x.shape[d]
    n_cols = x.numel() // n_rows if n_rows else 0
    rows = x.permute(*kept, *dims).reshape(n_rows, n_cols) if x.dim() else x.reshape(1, 1)
    rows = rows.contiguous()
    out = torch.empty(n_rows, dtype=dtype, device=x.device)
    if n_rows:
        tile_rows, block, num_warps = row_settings(max(1, n_cols))
        compute = tl.float32 if dtype.is_floating_point else tl.int64
        _row_sum[(triton.cdiv(n_rows, tile_rows),)](rows, out, n_rows, n_cols, COMPUTE=compute, SQUARES=squares,
                                                    ROWS=tile_rows, BLOCK=block, num_warps=num_warps)
    return out.view(out_shape)
