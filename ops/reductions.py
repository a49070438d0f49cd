"""The reduction template: every reduction over any dimensions (one, several, all; keepdim) is one row-wise Triton
kernel over a (rows, reduced) view. The reduced dimensions are moved last (a copy only when they are not
already the innermost), and each program reduces a block of rows in fp32 (fp64 for fp64, int64 for
integers: exact).

Three kernels share that layout: `_row_reduce` (sum, prod, max, min: what `KIND` names), `_row_arg` (the
value and the first index of the max or min: argmax, argmin, max.dim, min.dim) and `_row_moments` (two
passes over each row: var/std with their mean, logsumexp). The ops built on them: `sum`, `mean`, `prod`,
`amax`, `amin`, `argmax`, `argmin`, `var`, `std`, `var_mean`, `std_mean`, `all`, `any`, `logsumexp`,
`vector_norm`, `count_nonzero`, `nansum`; `ATEN` holds the functions of the ATen overloads it routes. `ops.sum` is
differentiable (its backward is an expand, a view); under `ops.enable()` PyTorch's own derivative formulas
call the routed forward ops.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ops.rows import row_block
from ops.settings import row_settings

KIND = {"sum": 0, "prod": 1, "max": 2, "min": 3}


@triton.jit
def _nan_aware(acc, m):
    """m (a row's max or min of `acc`) made NaN where the row holds a NaN, as PyTorch propagates it."""
    if acc.dtype.is_floating():
        nan = tl.sum((acc != acc).to(tl.int32), axis=1) > 0
        return tl.where(nan, float("nan"), m)
    else:
        return m


@triton.jit(do_not_specialize=["n_rows", "n_cols"])
def _row_reduce(x_ptr, y_ptr, n_rows, n_cols, neutral, OP: tl.constexpr, COMPUTE: tl.constexpr,
                ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows, row_mask = row_block(n_rows, ROWS)
    acc = tl.zeros([ROWS, BLOCK], dtype=COMPUTE) + tl.cast(neutral, COMPUTE)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(COMPUTE)
        x = tl.where(mask, x, tl.cast(neutral, COMPUTE))
        if OP == 0:
            acc += x
        elif OP == 1:
            acc *= x
        elif OP == 2:
            acc = tl.where((x > acc) | (x != x), x, acc)
        else:
            acc = tl.where((x < acc) | (x != x), x, acc)
    if OP == 0:
        total = tl.sum(acc, axis=1)
    elif OP == 1:
        total = tl.reduce(acc, 1, _multiply)
    elif OP == 2:
        total = _nan_aware(acc, tl.max(acc, axis=1))
    else:
        total = _nan_aware(acc, tl.min(acc, axis=1))
    tl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _multiply(a, b):
    return a * b


@triton.jit(do_not_specialize=["n_rows", "n_cols"])
def _row_arg(x_ptr, y_ptr, i_ptr, n_rows, n_cols, neutral, MAX: tl.constexpr, COMPUTE: tl.constexpr,
             ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows, row_mask = row_block(n_rows, ROWS)
    acc = tl.zeros([ROWS, BLOCK], dtype=COMPUTE) + tl.cast(neutral, COMPUTE)
    where = tl.zeros([ROWS, BLOCK], dtype=tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(COMPUTE)
        better = (x > acc) | (x != x) & (acc == acc) if MAX else (x < acc) | (x != x) & (acc == acc)
        better = better & mask
        acc = tl.where(better, x, acc)
        where = tl.where(better, cols[None, :].to(tl.int64), where)
    m = _nan_aware(acc, tl.max(acc, axis=1)) if MAX else _nan_aware(acc, tl.min(acc, axis=1))
    hit = (acc == m[:, None]) | ((acc != acc) & (m != m)[:, None])
    index = tl.min(tl.where(hit, where, n_cols), axis=1)
    tl.store(y_ptr + rows, m.to(y_ptr.dtype.element_ty), mask=row_mask)
    tl.store(i_ptr + rows, index, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols"])
def _row_moments(x_ptr, y_ptr, m_ptr, n_rows, n_cols, correction, LSE: tl.constexpr, COMPUTE: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """LSE: y = logsumexp (m = the row max); else y = the variance with `correction`, m = the mean."""
    rows, row_mask = row_block(n_rows, ROWS)
    acc = tl.zeros([ROWS, BLOCK], dtype=COMPUTE) + (float("-inf") if LSE else 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(COMPUTE)
        if LSE:
            acc = tl.where(mask & ((x > acc) | (x != x)), x, acc)
        else:
            acc += x
    if LSE:
        center = _nan_aware(acc, tl.max(acc, axis=1))
        shift = tl.where(tl.abs(center) == float("inf"), 0.0, center)
    else:
        center = tl.sum(acc, axis=1) / n_cols
        shift = center
    acc = tl.zeros([ROWS, BLOCK], dtype=COMPUTE)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(COMPUTE)
        d = x - shift[:, None]
        acc += tl.where(mask, tl.exp(d) if LSE else d * d, 0.0)
    total = tl.sum(acc, axis=1)
    if LSE:
        y = tl.where(tl.abs(center) == float("inf"), center, shift + tl.log(total))
    else:
        y = total / tl.maximum(n_cols - correction, 0.0)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)
    tl.store(m_ptr + rows, center.to(m_ptr.dtype.element_ty), mask=row_mask)


def _dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(x.dim(), 1) for d in dims})


def _rows(x: torch.Tensor, dim, keepdim: bool):
    """x as a contiguous (rows, reduced) matrix, and the result's shape."""
    dims = _dims(x, dim)
    kept = [d for d in range(x.dim()) if d not in dims]
    out_shape = [1 if d in dims else x.shape[d] for d in range(x.dim())] if keepdim else [x.shape[d] for d in kept]
    n_rows = math.prod(x.shape[d] for d in kept)
    n_cols = x.numel() // n_rows if n_rows else math.prod(x.shape[d] for d in dims)
    rows = x.permute(*kept, *dims).reshape(n_rows, n_cols) if x.dim() else x.reshape(1, 1)
    return rows.contiguous(), n_rows, n_cols, out_shape


def _compute(dtype: torch.dtype):
    if dtype == torch.float64:
        return tl.float64
    return tl.float32 if dtype.is_floating_point else tl.int64


def _grid(n_rows: int, n_cols: int):
    tile_rows, block, num_warps = row_settings(max(1, n_cols))
    return (triton.cdiv(n_rows, tile_rows),), {"ROWS": tile_rows, "BLOCK": block, "num_warps": num_warps}


def _lowest(dtype: torch.dtype, highest: bool = False):
    if dtype.is_floating_point:
        return math.inf if highest else -math.inf
    if dtype == torch.bool:
        return int(highest)
    info = torch.iinfo(torch.int64 if dtype != torch.uint8 else torch.uint8)
    return info.max if highest else info.min


def reduce(x: torch.Tensor, dim, keepdim: bool, kind: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The template: the sum, product, max or min of `x` over `dim` (None or []: every dimension)."""
    if x.is_complex():
        raise ValueError(f"{kind} of {x.dtype}: the kernels reduce real numbers")
    if dtype is None:
        dtype = x.dtype if x.is_floating_point() or kind in ("max", "min") else torch.int64
    rows, n_rows, n_cols, out_shape = _rows(x, dim, keepdim)
    if kind in ("max", "min") and n_cols == 0 and n_rows:
        raise IndexError(f"{kind}: the reduced dimensions of a tensor of shape {tuple(x.shape)} are empty")
    out = torch.empty(n_rows, dtype=dtype, device=x.device)
    neutral = {"sum": 0, "prod": 1, "max": _lowest(x.dtype), "min": _lowest(x.dtype, highest=True)}[kind]
    if n_rows:
        compute = _compute(dtype if kind in ("sum", "prod") else x.dtype)
        grid, settings = _grid(n_rows, n_cols)
        _row_reduce[grid](rows, out, n_rows, n_cols, neutral, OP=KIND[kind], COMPUTE=compute, **settings)
    return out.view(out_shape)


def arg_reduce(x: torch.Tensor, dim, keepdim: bool, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, first indices) of the max (`largest`) or min over one dimension, or over all when None."""
    flat = dim is None
    source = x.reshape(-1) if flat else x
    rows, n_rows, n_cols, out_shape = _rows(source, 0 if flat else dim, keepdim and not flat)
    if n_cols == 0:
        raise IndexError(f"{'argmax' if largest else 'argmin'}: the reduced dimension of a tensor of shape "
                         f"{tuple(x.shape)} is empty")
    values = torch.empty(n_rows, dtype=x.dtype, device=x.device)
    index = torch.empty(n_rows, dtype=torch.int64, device=x.device)
    if n_rows:
        grid, settings = _grid(n_rows, n_cols)
        _row_arg[grid](rows, values, index, n_rows, n_cols, _lowest(x.dtype, highest=not largest), MAX=largest,
                       COMPUTE=_compute(x.dtype), **settings)
    if flat and keepdim:
        out_shape = [1] * x.dim()
    return values.view(out_shape), index.view(out_shape)


def moments(x: torch.Tensor, dim, keepdim: bool, correction: float = 1, lse: bool = False):
    """(variance, mean) with `correction` over `dim`; with `lse`, (logsumexp, max)."""
    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    rows, n_rows, n_cols, out_shape = _rows(x, dim, keepdim)
    y = torch.empty(n_rows, dtype=dtype, device=x.device)
    m = torch.empty(n_rows, dtype=dtype, device=x.device)
    if n_rows:
        grid, settings = _grid(n_rows, n_cols)
        _row_moments[grid](rows, y, m, n_rows, n_cols, float(correction), LSE=lse, COMPUTE=_compute(dtype),
                           **settings)
    return y.view(out_shape), m.view(out_shape)


class _Sum(torch.autograd.Function):
    """The gradient of a sum is the incoming gradient expanded back over the summed dimensions: a view."""

    @staticmethod
    def forward(ctx, x, dim, keepdim, dtype):
        ctx.shape, ctx.dims, ctx.dtype = x.shape, _dims(x, dim), x.dtype
        return reduce(x, dim, keepdim, "sum", dtype)

    @staticmethod
    def backward(ctx, g):
        kept = [1 if d in ctx.dims else size for d, size in enumerate(ctx.shape)]
        return g.reshape(kept).expand(ctx.shape).to(ctx.dtype), None, None, None


def sum(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.sum`: over `dim` (an int, a list, or None/[] for every dimension), differentiable."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Sum.apply(x, dim, keepdim, dtype)
    return reduce(x, dim, keepdim, "sum", dtype)


def _sum(x: torch.Tensor, dim, keepdim: bool, dtype: torch.dtype | None, squares: bool = False) -> torch.Tensor:
    """The sum over `dim`; with `squares`, the 2-norm (the root of the sum of squares, floats only)."""
    from ops.pointwise_ops import OPS

    if not squares:
        return reduce(x, dim, keepdim, "sum", dtype)
    source = x if dtype is None or dtype == x.dtype else x.to(dtype)
    return OPS["sqrt"](reduce(OPS["mul"](source, source), dim, keepdim, "sum", torch.float32 if source.dtype in (
        torch.float16, torch.bfloat16) else source.dtype)).to(dtype or x.dtype)


def mean(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.mean` (floats only, as PyTorch)."""
    from ops.pointwise_ops import OPS

    if not (x.is_floating_point() or (dtype is not None and dtype.is_floating_point)):
        raise RuntimeError(f"mean(): could not infer output dtype. Input dtype must be floating, got {x.dtype}")
    out_dtype = dtype or x.dtype
    total = reduce(x, dim, keepdim, "sum", torch.float64 if out_dtype == torch.float64 else torch.float32)
    count = math.prod(x.shape[d] for d in _dims(x, dim)) if x.dim() else 1
    return OPS["div"](total, count).to(out_dtype)


def all_any(x: torch.Tensor, dim, keepdim: bool, any_: bool) -> torch.Tensor:
    """`torch.all` / `torch.any`: the min / max of `x != 0` (bool; uint8 stays uint8, as PyTorch)."""
    from ops.pointwise_ops import OPS

    out = reduce(OPS["ne"](x, 0), dim, keepdim, "max" if any_ else "min") if x.numel() else None
    if out is None:  # an empty reduction: all() of nothing holds, any() of nothing does not
        _, _, _, shape = _rows(x, dim, keepdim)
        out = torch.full(shape, not any_, dtype=torch.bool, device=x.device)
    return out.to(torch.uint8) if x.dtype == torch.uint8 else out


def vector_norm(x: torch.Tensor, ord=2, dim=None, keepdim: bool = False, dtype=None) -> torch.Tensor:
    """`torch.linalg.vector_norm`: any order, from the template (2: the root of the sum of squares)."""
    from ops.pointwise_ops import OPS

    source = x if dtype is None else x.to(dtype)
    a = OPS["abs"](source)
    if ord == math.inf:
        return reduce(a, dim, keepdim, "max") if a.numel() else reduce(a, dim, keepdim, "sum")
    if ord == -math.inf:
        return reduce(a, dim, keepdim, "min")
    if ord == 0:
        return reduce(OPS["ne"](a, 0), dim, keepdim, "sum", source.dtype)
    if ord == 1:
        return reduce(a, dim, keepdim, "sum")
    if ord == 2:
        return _sum(source, dim, keepdim, source.dtype, squares=True)
    wide = a.to(torch.float32) if a.dtype in (torch.float16, torch.bfloat16) else a  # |x|**ord overflows 16 bits
    return OPS["pow"](reduce(OPS["pow"](wide, ord), dim, keepdim, "sum"), 1.0 / ord).to(source.dtype)


def _dim_list(dim):
    return None if dim is None else ([dim] if isinstance(dim, int) else list(dim))


def _correction(correction, unbiased=True):
    return (1 if unbiased else 0) if correction is None else correction


def _var(self, dim=None, *, correction=None, keepdim=False):
    return moments(self, _dim_list(dim), keepdim, _correction(correction))[0]


def _std(self, dim=None, *, correction=None, keepdim=False):
    from ops.pointwise_ops import OPS

    return OPS["sqrt"](_var(self, dim, correction=correction, keepdim=keepdim))


def _var_mean(self, dim=None, *, correction=None, keepdim=False):
    return moments(self, _dim_list(dim), keepdim, _correction(correction))


def _std_mean(self, dim=None, *, correction=None, keepdim=False):
    from ops.pointwise_ops import OPS

    var, m = _var_mean(self, dim, correction=correction, keepdim=keepdim)
    return OPS["sqrt"](var), m


def _nansum(self, dim=None, keepdim=False, *, dtype=None):
    from ops.pointwise_ops import OPS, where

    clean = where(OPS["isnan"](self), 0, self) if self.is_floating_point() else self
    return reduce(clean, _dim_list(dim), keepdim, "sum", dtype)


def _count_nonzero(self, dim=None):
    from ops.pointwise_ops import OPS

    return reduce(OPS["ne"](self, 0), _dim_list(dim), False, "sum", torch.int64)


def _aminmax(self, *, dim=None, keepdim=False):
    return reduce(self, dim, keepdim, "min"), reduce(self, dim, keepdim, "max")


def _extreme(kind):
    def full(self):
        return reduce(self, None, False, kind)

    def along(self, dim, keepdim=False):
        return arg_reduce(self, dim, keepdim, kind == "max")

    return full, along


def _arg(largest):
    return lambda self, dim=None, keepdim=False: arg_reduce(self, dim, keepdim, largest)[1]


def _norm(self, p=2, dim=None, keepdim=False, *, dtype=None):
    return vector_norm(self, 2 if p is None else p, _dim_list(dim), keepdim, dtype)


ATEN = {
    "sum": lambda self, *, dtype=None: reduce(self, None, False, "sum", dtype),
    "sum.dim_IntList": lambda self, dim, keepdim=False, *, dtype=None: reduce(self, dim, keepdim, "sum",
                                                                                       dtype),
    "mean": lambda self, *, dtype=None: mean(self, None, False, dtype),
    "mean.dim": lambda self, dim, keepdim=False, *, dtype=None: mean(self, dim, keepdim, dtype),
    "prod": lambda self, *, dtype=None: reduce(self, None, False, "prod", dtype),
    "prod.dim_int": lambda self, dim, keepdim=False, *, dtype=None: reduce(self, dim, keepdim, "prod",
                                                                                     dtype),
    "amax": lambda self, dim=(), keepdim=False: reduce(self, dim, keepdim, "max"),
    "amin": lambda self, dim=(), keepdim=False: reduce(self, dim, keepdim, "min"),
    "max": _extreme("max")[0], "max.dim": _extreme("max")[1],
    "min": _extreme("min")[0], "min.dim": _extreme("min")[1],
    "argmax": _arg(True), "argmin": _arg(False),
    "var.correction": _var, "std.correction": _std,
    "var_mean.correction": _var_mean, "std_mean.correction": _std_mean,
    "all": lambda self: all_any(self, None, False, False),
    "all.dim": lambda self, dim, keepdim=False: all_any(self, dim, keepdim, False),
    "all.dims": lambda self, dim=None, keepdim=False: all_any(self, dim, keepdim, False),
    "any": lambda self: all_any(self, None, False, True),
    "any.dim": lambda self, dim, keepdim=False: all_any(self, dim, keepdim, True),
    "any.dims": lambda self, dim=None, keepdim=False: all_any(self, dim, keepdim, True),
    "logsumexp": lambda self, dim, keepdim=False: moments(self, dim, keepdim, lse=True)[0],
    "norm.Scalar": lambda self, p=2: vector_norm(self, p),
    "norm.ScalarOpt_dim": lambda self, p, dim, keepdim=False: _norm(self, p, dim, keepdim),
    "norm.ScalarOpt_dim_dtype": lambda self, p, dim, keepdim, *, dtype: _norm(self, p, dim, keepdim,
                                                                                        dtype=dtype),
    "nansum": _nansum,
    "count_nonzero": _count_nonzero, "count_nonzero.dim_IntList": _count_nonzero,
    "aminmax": _aminmax,
}
