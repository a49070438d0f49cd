"""The scan template: cumsum, cumprod, cummax and cummin along one dimension, over a (rows, scanned) view.

The scanned dimension is moved last (a copy only when it is not innermost); each program walks one row in
blocks, scanning each block with `tl.associative_scan` and carrying the running total into the next, in fp32
(fp64 for fp64, int64 for integers and bools, whose results are int64 as PyTorch's). `ATEN` holds the
functions of the ATen overloads it routes: `cumsum`, `cumprod` and their in-place forms, and `cummax`/`cummin`
(`_row_scan_arg`: the running extreme with its index, scanned as pairs: a later equal value wins, a NaN stays);
their backwards are PyTorch's formulas, which call the routed ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.reductions import _compute

SCAN_BLOCK = 1024


@triton.jit
def _times(a, b):
    return a * b


@triton.jit
def _plus(a, b):
    return a + b


@triton.jit(do_not_specialize=["n_cols"])
def _row_scan(x_ptr, y_ptr, n_cols, PROD: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    carry = tl.zeros([1], dtype=COMPUTE) + (1 if PROD else 0)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=1 if PROD else 0).to(COMPUTE)
        if PROD:
            run = tl.associative_scan(x, 0, _times) * carry
            carry = tl.sum(tl.where(offs == BLOCK - 1, run, 0), axis=0) + tl.zeros([1], dtype=COMPUTE)
        else:
            run = tl.associative_scan(x, 0, _plus) + carry
            carry = carry + tl.sum(x, axis=0)
        tl.store(y_ptr + row * n_cols + cols, run.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _later_max(v1, i1, v2, i2):
    """The running max with its index: a later equal value wins, a NaN wins and stays (PyTorch's cummax)."""
    take = (v2 != v2) | ((v1 == v1) & (v2 >= v1))
    return tl.where(take, v2, v1), tl.where(take, i2, i1)


@triton.jit
def _later_min(v1, i1, v2, i2):
    take = (v2 != v2) | ((v1 == v1) & (v2 <= v1))
    return tl.where(take, v2, v1), tl.where(take, i2, i1)


@triton.jit(do_not_specialize=["n_cols"])
def _row_scan_arg(x_ptr, y_ptr, i_ptr, n_cols, neutral, MAX: tl.constexpr, COMPUTE: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    carry_v = tl.zeros([BLOCK], dtype=COMPUTE) + tl.cast(neutral, COMPUTE)
    carry_i = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0).to(COMPUTE)
        x = tl.where(mask, x, tl.cast(neutral, COMPUTE))
        if MAX:
            run_v, run_i = tl.associative_scan((x, cols.to(tl.int64)), 0, _later_max)
            run_v, run_i = _later_max(carry_v, carry_i, run_v, run_i)
        else:
            run_v, run_i = tl.associative_scan((x, cols.to(tl.int64)), 0, _later_min)
            run_v, run_i = _later_min(carry_v, carry_i, run_v, run_i)
        tl.store(y_ptr + row * n_cols + cols, run_v.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(i_ptr + row * n_cols + cols, run_i, mask=mask)
        last = offs == BLOCK - 1
        carry_v = tl.zeros([BLOCK], dtype=COMPUTE) + tl.sum(tl.where(last, run_v, 0), axis=0)
        carry_i = tl.zeros([BLOCK], dtype=tl.int64) + tl.sum(tl.where(last, run_i, 0), axis=0)


def scan_arg(x: torch.Tensor, dim: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the running max (`largest`) or min of `x` along `dim`: cummax / cummin."""
    from ops.reductions import _lowest

    d = dim % max(x.dim(), 1)
    rows = (x.movedim(d, -1) if x.dim() else x.reshape(1)).contiguous()
    n_cols = rows.shape[-1]
    values = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    index = torch.empty(rows.shape, dtype=torch.int64, device=x.device)
    if values.numel():
        _row_scan_arg[(values.numel() // n_cols,)](rows, values, index, n_cols, _lowest(x.dtype, not largest),
                                                     MAX=largest, COMPUTE=_compute(x.dtype),
                                                     BLOCK=min(SCAN_BLOCK, triton.next_power_of_2(n_cols)),
                                                     num_warps=4)
    if not x.dim():
        return values.reshape(()), index.reshape(())
    return values.movedim(-1, d), index.movedim(-1, d)


def scan(x: torch.Tensor, dim: int, prod: bool, dtype: torch.dtype | None = None, out=None) -> torch.Tensor:
    """The running sum (or product) of `x` along `dim`."""
    if x.is_complex():
        raise ValueError(f"{'cumprod' if prod else 'cumsum'} of {x.dtype}: the kernel scans real numbers")
    dtype = dtype or (x.dtype if x.is_floating_point() else torch.int64)
    d = dim % max(x.dim(), 1)
    moved = x.movedim(d, -1) if x.dim() else x.reshape(1)
    rows = moved.contiguous()
    n_cols = rows.shape[-1] if rows.dim() else 1
    result = torch.empty(rows.shape, dtype=dtype, device=x.device)
    if result.numel():
        block = min(SCAN_BLOCK, triton.next_power_of_2(n_cols))
        _row_scan[(result.numel() // n_cols,)](rows, result, n_cols, PROD=prod, COMPUTE=_compute(dtype),
                                                 BLOCK=block, num_warps=4)
    result = result.movedim(-1, d) if x.dim() else result.reshape(())
    if out is not None:
        return out.copy_(result)
    return result


ATEN = {
    "cumsum": lambda self, dim, *, dtype=None: scan(self, dim, False, dtype),
    "cumsum_": lambda self, dim, *, dtype=None: scan(self, dim, False, dtype, out=self),
    "cumprod": lambda self, dim, *, dtype=None: scan(self, dim, True, dtype),
    "cumprod_": lambda self, dim, *, dtype=None: scan(self, dim, True, dtype, out=self),
    "cummax": lambda self, dim: scan_arg(self, dim, True),
    "cummin": lambda self, dim: scan_arg(self, dim, False),
}
