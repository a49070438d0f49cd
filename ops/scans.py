"""The scan template: cumsum and cumprod along one dimension, one Triton kernel over a (rows, scanned) view.

The scanned dimension is moved last (a copy only when it is not innermost); each program walks one row in
blocks, scanning each block with `tl.associative_scan` and carrying the running total into the next, in fp32
(fp64 for fp64, int64 for integers and bools, whose results are int64 as PyTorch's). `ATEN` holds the rows
`ops.aten` routes: `cumsum`, `cumprod` and their in-place forms; their backwards are PyTorch's formulas,
which call the routed ops.
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


ATEN = [
    ("cumsum", "cumsum", lambda self, dim, *, dtype=None: scan(self, dim, False, dtype)),
    ("cumsum", "cumsum_", lambda self, dim, *, dtype=None: scan(self, dim, False, dtype, out=self)),
    ("cumprod", "cumprod", lambda self, dim, *, dtype=None: scan(self, dim, True, dtype)),
    ("cumprod", "cumprod_", lambda self, dim, *, dtype=None: scan(self, dim, True, dtype, out=self)),
]
