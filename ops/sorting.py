"""The sort template: `sort` (stable, ascending or descending), `topk` and, through PyTorch's decompositions,
`argsort` and `msort`, along one dimension, for every real dtype.

The sorted dimension is moved last (a copy only when it is not innermost). `_sort_keys` turns each element
into an int64 key whose integer order is the value order PyTorch sorts by (a float's bits with the
negative ones' magnitude bits flipped, -0.0 as 0.0 and every NaN as one NaN above +inf; an integer as
itself; descending: the key's complement) and notes its position. Then a merge sort: pass after pass,
`_merge_pass` merges neighbouring sorted runs of `width` into runs of `2 * width`, each element finding its
place by a binary search in the other run (an element of the left run counts the right run's keys below
its own, one of the right run those at or below its own: equal keys keep their order, so the sort is
stable). log2(length) passes of O(log width) reads per element; no row length limit. The values are then
read at the sorted positions (`ops.indexing.take`). `topk` is the first k of that sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import indexing
from ops.settings import POINTWISE_BLOCK, warps


@triton.jit
def _sort_keys(x_ptr, key_ptr, idx_ptr, n, n_cols, FLOAT: tl.constexpr, WIDE: tl.constexpr,
               DESCENDING: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    if FLOAT:
        if WIDE:
            v = x.to(tl.float64)
            v = tl.where(v != v, float("nan"), tl.where(v == 0, 0.0, v))
            bits = v.to(tl.int64, bitcast=True)
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
        else:
            v = x.to(tl.float32)
            v = tl.where(v != v, float("nan"), tl.where(v == 0, 0.0, v))
            bits = v.to(tl.int32, bitcast=True)
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    else:
        key = x.to(tl.int64)
    if DESCENDING:
        key = ~key
    tl.store(key_ptr + offs, key, mask=mask)
    tl.store(idx_ptr + offs, offs % n_cols, mask=mask)


@triton.jit(do_not_specialize=["width", "steps"])
def _merge_pass(key_ptr, idx_ptr, key_out, idx_out, n, n_cols, width, steps, BLOCK: tl.constexpr):
    """Runs of `width` sorted keys (each row's last run may be short) merged in pairs into runs of 2 * width."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row = offs // n_cols * n_cols
    p = offs % n_cols
    start = p // (2 * width) * (2 * width)
    left = p - start < width
    mid = tl.minimum(start + width, n_cols)
    end = tl.minimum(start + 2 * width, n_cols)
    other = tl.where(left, mid, start)
    length = tl.where(left, end - mid, mid - start)
    own = tl.where(left, p - start, p - mid)
    key = tl.load(key_ptr + offs, mask=mask, other=0)
    idx = tl.load(idx_ptr + offs, mask=mask, other=0)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = length
    for _ in range(steps):  # lo ends at the count of the other run's keys before this one's
        active = mask & (lo < hi)
        half = (lo + hi) // 2
        probe = tl.load(key_ptr + row + other + half, mask=active, other=0)
        before = tl.where(left, probe < key, probe <= key)
        lo = tl.where(active & before, half + 1, lo)
        hi = tl.where(active & ~before, half, hi)
    dest = row + start + own + lo
    tl.store(key_out + dest, key, mask=mask)
    tl.store(idx_out + dest, idx, mask=mask)


def _order(rows: torch.Tensor, descending: bool) -> torch.Tensor:
    """The positions that sort each row of the contiguous (rows, n_cols) tensor `rows`, stably."""
    n = rows.numel()
    n_cols = rows.shape[-1]
    key = torch.empty(rows.shape, dtype=torch.int64, device=rows.device)
    idx = torch.empty(rows.shape, dtype=torch.int64, device=rows.device)
    if not n:
        return idx
    grid = (triton.cdiv(n, POINTWISE_BLOCK),)
    _sort_keys[grid](rows, key, idx, n, n_cols, FLOAT=rows.is_floating_point(), WIDE=rows.dtype == torch.float64,
                     DESCENDING=descending, BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))
    spare_key, spare_idx = torch.empty_like(key), torch.empty_like(idx)
    width = 1
    while width < n_cols:
        _merge_pass[grid](key, idx, spare_key, spare_idx, n, n_cols, width, width.bit_length() + 1,
                          BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))
        key, spare_key, idx, spare_idx = spare_key, key, spare_idx, idx
        width *= 2
    return idx


def sort(x: torch.Tensor, dim: int = -1, descending: bool = False, k: int | None = None):
    """(values, indices) of `x` sorted along `dim` (stable); with `k`, only the first k of each row."""
    if x.is_complex():
        raise ValueError(f"sort of {x.dtype}: the kernels sort real numbers")
    if x.dim() == 0:  # sorted as one element, its shape kept
        if k not in (None, 0, 1):
            raise IndexError(f"topk: k ({k}) is out of range for a 0-dim tensor")
        values, order = sort(x.reshape(1), 0, descending, k)
        return (values.reshape(()), order.reshape(())) if k != 0 else (values, order)
    d = dim % x.dim()
    if k is not None and not 0 <= k <= x.shape[d]:
        raise IndexError(f"topk: k ({k}) is out of range for dimension {d} of size {x.shape[d]}")
    rows = x.movedim(d, -1).contiguous()
    order = _order(rows, descending)
    if k is not None:
        order = order[..., :k].contiguous()
    values = indexing.take(rows, -1, order, per_element=True) if order.numel() else \
        torch.empty(order.shape, dtype=x.dtype, device=x.device)
    return values.movedim(-1, d).contiguous(), order.movedim(-1, d).contiguous()


def _sort_stable(self, *, stable=None, dim=-1, descending=False):
    return sort(self, dim, descending)


def _topk(self, k, dim=-1, largest=True, sorted=True):
    return sort(self, dim, largest, k)


ATEN = {
    "sort": lambda self, dim=-1, descending=False: sort(self, dim, descending),
    "sort.stable": _sort_stable,
    "topk": _topk,
}
