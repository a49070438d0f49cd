"""Indexing and shape ops: two Triton kernels (`_take`: read along one dimension at given positions;
`_put`: write or add along one dimension at given positions), `_arange`, and ops composed of these and of the
generated pointwise kernels: index_select, gather, scatter, scatter_add, index_add, index_put, cat, flip, repeat,
tril/triu, arange, full/zeros/ones, masked_select, nonzero, mse_loss and nll_loss (forward and backward), index
(`x[i]`), isin, masked_scatter. The random ops are `ops.sampling`'s.

Tensors are read as (outer, dim, inner) contiguous views, so a non-contiguous input is copied once (by the
routed copy kernel). `masked_select` and `nonzero` size their output from a count (`.item()`, one sync,
as PyTorch's do); their positions come from the scan kernel. `ATEN` holds the functions of the ATen overloads it routes.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from ops import pointwise_ops, reductions, scans
from ops.catalog import Declined
from ops.pointwise_codegen import pointwise
from ops.pointwise_ops import OPS
from ops.settings import POINTWISE_BLOCK, warps


@triton.jit
def _take(src_ptr, index_ptr, out_ptr, n, size_j, size_k, size_s, PER_ELEMENT: tl.constexpr, BLOCK: tl.constexpr):
    """out[o, j, k] = src[o, index[o, j, k] (or index[j]), k]; src is (outer, size_s, size_k)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    k = offs % size_k
    j = (offs // size_k) % size_j
    o = offs // (size_k * size_j)
    idx = tl.load(index_ptr + (offs if PER_ELEMENT else j), mask=mask, other=0).to(tl.int64)
    idx = tl.where(idx < 0, idx + size_s, idx)
    tl.device_assert((idx >= 0) & (idx < size_s), "index out of range")
    v = tl.load(src_ptr + (o * size_s + idx) * size_k + k, mask=mask, other=0)
    tl.store(out_ptr + offs, v, mask=mask)


@triton.jit
def _put(out_ptr, index_ptr, src_ptr, n, size_j, size_k, size_s, PER_ELEMENT: tl.constexpr, ADD: tl.constexpr,
         BLOCK: tl.constexpr):
    """out[o, index[...], k] = (or +=) src[o, j, k]; out is (outer, size_s, size_k)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    k = offs % size_k
    j = (offs // size_k) % size_j
    o = offs // (size_k * size_j)
    idx = tl.load(index_ptr + (offs if PER_ELEMENT else j), mask=mask, other=0).to(tl.int64)
    idx = tl.where(idx < 0, idx + size_s, idx)
    v = tl.load(src_ptr + offs, mask=mask, other=0)
    target = out_ptr + (o * size_s + idx) * size_k + k
    if ADD:
        tl.atomic_add(target, v, mask=mask)
    else:
        tl.store(target, v, mask=mask)


@triton.jit
def _arange(out_ptr, n, start, step, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, (start + offs * step).to(out_ptr.dtype.element_ty), mask=offs < n)


def _grid(n: int):
    return (triton.cdiv(n, POINTWISE_BLOCK),)


def _split(shape, dim: int):
    return math.prod(shape[:dim]), shape[dim] if len(shape) else 1, math.prod(shape[dim + 1:])


def take(src: torch.Tensor, dim: int, index: torch.Tensor, per_element: bool) -> torch.Tensor:
    """index_select (`index` 1-D) or gather (`index` of the output's shape) along `dim`."""
    dim = dim % max(src.dim(), 1)
    index = index.contiguous()
    if per_element:
        shape = list(index.shape)
        src = src[tuple(slice(0, s) if d != dim else slice(None) for d, s in enumerate(shape))] if src.dim() else src
    else:
        shape = list(src.shape)
        if src.dim():
            shape[dim] = index.numel()
    src = src.contiguous()
    out = torch.empty(shape, dtype=src.dtype, device=src.device)
    outer, size_s, inner = _split(list(src.shape), dim)
    n = out.numel()
    if n:
        _take[_grid(n)](src, index, out, n, index.numel() // max(1, outer * inner) if per_element else index.numel(),
                        inner, size_s, PER_ELEMENT=per_element, BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))
    return out


def put(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, per_element: bool, add: bool,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """scatter / scatter_add (`index` of src's shape) or index_copy / index_add (`index` 1-D) along `dim`,
    into a copy of `self` (or `out`). Sums are taken in fp32 for 16-bit dtypes."""
    if add and self.dtype == torch.bool:
        raise Declined("an atomic add of bools")
    dim = dim % max(self.dim(), 1)
    wide = add and self.dtype in (torch.float16, torch.bfloat16)
    result = self.to(torch.float32 if wide else self.dtype, memory_format=torch.contiguous_format).clone()
    index = index.contiguous()
    if per_element and src.dim():
        src = src[tuple(slice(0, s) for s in index.shape)]
    src = src.to(result.dtype).contiguous()
    outer, size_s, inner = _split(list(result.shape), dim)
    n = index.numel() if per_element else src.numel()
    if n:
        size_j = index.numel() if not per_element else index.shape[dim] if index.dim() else 1
        inner_src = math.prod(index.shape[dim + 1:]) if per_element else inner
        if per_element and (inner_src != inner or math.prod(index.shape[:dim]) != outer):
            raise ValueError(f"scatter: index {tuple(index.shape)} must match the destination "
                             f"{tuple(result.shape)} in every dimension but {dim}")
        _put[_grid(n)](result, index, src, n, size_j, inner, size_s, PER_ELEMENT=per_element, ADD=add,
                       BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))
    result = result.to(self.dtype)
    return result if out is None else out.copy_(result)


def _positions(index: torch.Tensor, dim: int, shape) -> torch.Tensor:
    """For each element of `index`, the flat position in a contiguous tensor of `shape` of the element it
    names: its own coordinates, but along `dim` the index's value (gather's and scatter's addressing)."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    idx = pointwise_ops.where(OPS["lt"](index, 0), pointwise_ops.add(index, shape[dim]), index)
    linear = pointwise_ops.mul(idx, strides[dim])
    for d in range(index.dim()):
        if d != dim and index.shape[d] > 1:
            coord = arange(index.shape[d], device=index.device).view([-1 if e == d else 1 for e in range(index.dim())])
            linear = pointwise_ops.add(linear, pointwise_ops.mul(coord, strides[d]))
    return linear.expand(index.shape).reshape(-1)


def gather(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """`torch.gather`: out[i..] = self[i.., index[i..] along dim, i..]; the index may be smaller than self."""
    shape = list(self.shape) or [1]
    dim = dim % len(shape)
    if not index.numel():
        return torch.empty(index.shape, dtype=self.dtype, device=self.device)
    where = _positions(index if index.dim() else index.reshape(1), dim, shape)
    return take(self.contiguous().reshape(-1), 0, where, per_element=False).view(index.shape)


def scatter(self: torch.Tensor, dim: int, index: torch.Tensor, src, add: bool, out=None) -> torch.Tensor:
    """`scatter` / `scatter_add`: self[i.., index[i..] along dim, i..] = (or +=) src[i..], over index's elements
    (the index may be smaller than self and src); `src` a tensor or a number."""
    shape = list(self.shape) or [1]
    dim = dim % len(shape)
    if not index.numel():
        return OPS["copy"](self) if out is None else out
    index = index if index.dim() else index.reshape(1)
    if isinstance(src, torch.Tensor) and src.dim():
        values = src[tuple(slice(0, s) for s in index.shape)]
    else:
        values = torch.full(index.shape, src.item() if isinstance(src, torch.Tensor) else src, dtype=self.dtype,
                            device=self.device)
    where = _positions(index, dim, shape)
    result = put(self.reshape(-1), 0, where, values.reshape(-1), False, add).view(self.shape)
    return result if out is None else OPS["copy"](result, out=out)


def cat(tensors, dim: int = 0) -> torch.Tensor:
    """`torch.cat`: each input copied (by the routed copy kernel) into its slice of the output."""
    tensors = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)] or list(tensors[:1])
    dim = dim % max(tensors[0].dim(), 1)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    out = torch.empty(shape, dtype=dtype, device=tensors[0].device)
    start = 0
    for t in tensors:
        if t.shape[dim]:
            OPS["copy"](t, out=out.narrow(dim, start, t.shape[dim]))
        start += t.shape[dim]
    return out


def arange(start, end=None, step=1, *, dtype=None, layout=None, device=None, pin_memory=None) -> torch.Tensor:
    if end is None:
        start, end = 0, start
    if dtype is None:
        dtype = torch.get_default_dtype() if any(isinstance(v, float) for v in (start, end, step)) else torch.int64
    n = _arange_size(start, end, step, dtype)
    if not dtype.is_floating_point:  # as ATen's arange: the bounds and step in the integer type, truncated
        start, step = int(start), int(step)
    out = torch.empty(n, dtype=dtype, device=device)
    if n:
        _arange[_grid(n)](out, n, start, step, BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))
    return out


def _arange_size(start, end, step, dtype: torch.dtype) -> int:
    """The length of `arange(start, end, step)` in `dtype` as ATen computes it (`compute_arange_size`): for int64,
    from the bounds and step truncated to integers, in integer arithmetic; else from them as doubles."""
    if dtype == torch.int64:
        start, end, step = int(start), int(end), int(step)
    if step == 0:
        raise ValueError("step must be nonzero")  # ATen: TORCH_CHECK_VALUE
    if dtype != torch.int64:
        return max(0, math.ceil((float(end) - float(start)) / float(step)))
    span = end - start + step - (1 if step > 0 else -1)
    quotient = abs(span) // abs(step)  # C++'s division, which truncates toward zero
    return max(0, quotient if (span >= 0) == (step > 0) else -quotient)


def flip(self: torch.Tensor, dims) -> torch.Tensor:
    out = self
    for d in dims:
        d = d % max(self.dim(), 1)
        size = self.shape[d] if self.dim() else 1
        out = take(out, d, arange(size - 1, -1, -1, device=self.device), per_element=False)
    return out if out is not self else OPS["copy"](self)


def repeat(self: torch.Tensor, repeats) -> torch.Tensor:
    """`Tensor.repeat`: the input expanded as a view, copied once into the result."""
    repeats = list(repeats)
    padded = [1] * (len(repeats) - self.dim()) + list(self.shape)
    view = self.reshape(padded)
    view = view.reshape([v for s in padded for v in (1, s)]).expand([v for r, s in zip(repeats, padded, strict=True)
                                                                     for v in (r, s)])
    out = torch.empty([r * s for r, s in zip(repeats, padded, strict=True)], dtype=self.dtype, device=self.device)
    OPS["copy"](view, out=out.view(view.shape))
    return out


@triton.jit
def _band(x, row, col, diagonal, LOWER: tl.constexpr):
    keep = (col - row <= diagonal) if LOWER else (col - row >= diagonal)
    return tl.where(keep, x, 0)


@triton.jit
def _lower(x, row, col, diagonal):
    return _band(x, row, col, diagonal, True)


@triton.jit
def _upper(x, row, col, diagonal):
    return _band(x, row, col, diagonal, False)


_BANDS = {True: pointwise()(_lower), False: pointwise()(_upper)}


def triangle(self: torch.Tensor, diagonal: int, lower: bool, out=None) -> torch.Tensor:
    rows = arange(self.shape[-2], device=self.device)[:, None]
    cols = arange(self.shape[-1], device=self.device)[None, :]
    out = torch.empty_like(self) if out is None else out
    return _BANDS[lower](self, rows, cols, diagonal, out=out)


def nonzero(self: torch.Tensor) -> torch.Tensor:
    """The indices of the nonzero elements (n, dim), in row-major order: positions from the scan kernel."""
    flat = OPS["ne"](self.reshape(-1), 0)
    position = scans.scan(flat, 0, False)
    count = int(position[-1].item()) if flat.numel() else 0
    linear = torch.empty(count, dtype=torch.int64, device=self.device)
    if count:
        where = pointwise_ops.sub(position, 1)
        slot = pointwise_ops.where(flat, where, count)  # the false ones go past the end, into a spare slot
        spare = torch.empty(count + 1, dtype=torch.int64, device=self.device)
        _put[_grid(flat.numel())](spare, slot, arange(flat.numel(), device=self.device), flat.numel(),
                                  flat.numel(), 1, count + 1, PER_ELEMENT=True, ADD=False, BLOCK=POINTWISE_BLOCK,
                                  num_warps=warps(POINTWISE_BLOCK))
        linear = spare[:count]
    coords = []
    for size in reversed(self.shape or ()):
        coords.append(OPS["remainder"](linear, size))
        linear = OPS["floor_divide"](linear, size)
    out = torch.empty(count, self.dim(), dtype=torch.int64, device=self.device)
    for d, c in enumerate(reversed(coords)):
        OPS["copy"](c, out=out[:, d])
    return out


def masked_select(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    idx = nonzero(mask.expand(shape).contiguous().reshape(-1)).reshape(-1)
    return take(self.expand(shape).contiguous().reshape(-1), 0, idx, per_element=False)


def index_put(self, indices, values, accumulate=False, out=None):
    """`x[i, j, ...] = values` (or +=) for index tensors on the leading dimensions: through the linear index."""
    if len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.bool:
        indices = [nonzero(indices[0])[:, d] for d in range(indices[0].dim())]
    if any(i is None for i in indices) or any(i.dtype == torch.bool for i in indices):
        raise ValueError("index_put: the routed kernel takes integer index tensors on the leading dimensions")
    lead = self.shape[:len(indices)]
    idx = torch.broadcast_shapes(*(i.shape for i in indices))
    linear = torch.zeros((), dtype=torch.int64, device=self.device)
    for i, size in zip(indices, lead, strict=True):
        linear = pointwise_ops.add(pointwise_ops.mul(linear, size), OPS["remainder"](i.expand(idx), size))
    rest = self.shape[len(indices):]
    flat = self.reshape(-1, *rest) if rest else self.reshape(-1)
    values = values.expand(*idx, *rest).reshape(-1, *rest) if rest else values.expand(idx).reshape(-1)
    result = put(flat, 0, linear.reshape(-1), values, False, accumulate).view(self.shape)
    return result if out is None else out.copy_(result)


def index(self, indices):
    """`x[i, j, ...]` with integer (or one boolean) index tensors on the leading dimensions: a take through the
    linear index; any other pattern (an index after a skipped dimension) is PyTorch's `index.Tensor_out`."""
    if len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.bool:
        mask = indices[0]
        if mask.shape != self.shape[:mask.dim()]:
            return _index_fallback(self, indices)
        indices = [nonzero(mask)[:, d] for d in range(mask.dim())]
    if not indices or any(i is None or i.dtype == torch.bool for i in indices):
        return _index_fallback(self, indices)
    lead = self.shape[:len(indices)]
    shape = torch.broadcast_shapes(*(i.shape for i in indices))
    linear = torch.zeros((), dtype=torch.int64, device=self.device)
    for i, size in zip(indices, lead, strict=True):
        linear = pointwise_ops.add(pointwise_ops.mul(linear, size), OPS["remainder"](i.expand(shape), size))
    rest = self.shape[len(indices):]
    flat = self.reshape(-1, *rest)
    return take(flat, 0, linear.reshape(-1), per_element=False).view(*shape, *rest)


def _index_fallback(self, indices):
    out = torch.empty(0, dtype=self.dtype, device=self.device)
    return torch.ops.aten.index.Tensor_out(self, indices, out=out)


def isin(elements, test_elements, *, assume_unique=False, invert=False):
    """`torch.isin`: each element against every test element (elements x tests comparisons, then any)."""
    tests = test_elements.reshape(-1)
    hit = reductions.all_any(OPS["eq"](elements.unsqueeze(-1), tests), -1, False, True) if tests.numel() else \
        torch.zeros(elements.shape, dtype=torch.bool, device=elements.device)
    return OPS["logical_not"](hit) if invert else hit


def masked_scatter(self, mask, source):
    """`Tensor.masked_scatter`: the masked positions take source's elements in order (positions from the scan)."""
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    flat_mask = mask.expand(shape).reshape(-1)
    position = pointwise_ops.sub(scans.scan(flat_mask, 0, False), 1)
    safe = pointwise_ops.where(flat_mask, position, 0)
    picked = take(source.reshape(-1), 0, safe, per_element=False) if source.numel() else safe.to(self.dtype)
    return pointwise_ops.where(flat_mask, picked, self.expand(shape).reshape(-1)).view(shape)


def masked_scatter_backward(grad_output, mask, sizes):
    """The gradient of masked_scatter's source: the masked gradient in order, zeros after."""
    selected = masked_select(grad_output, mask)
    out = _full([math.prod(sizes)], 0, dtype=grad_output.dtype, device=grad_output.device)
    if selected.numel():
        OPS["copy"](selected, out=out[:selected.numel()])
    return out.view(sizes)


def mse_loss(self, target, reduction=1):
    squares = OPS["mse"](self, target)
    if reduction == 0:
        return squares
    return reductions.mean(squares) if reduction == 1 else reductions.reduce(squares, None, False, "sum")


def mse_loss_backward(grad_output, self, target, reduction):
    scale = 1.0 / max(1, self.numel()) if reduction == 1 else 1.0
    return OPS["mse_backward"](grad_output, self, target, scale).to(self.dtype)


def _nll_parts(self, target, weight, ignore_index):
    valid = OPS["ne"](target, ignore_index)
    safe = pointwise_ops.where(valid, target, 0)
    w = (pointwise_ops.where(valid, take(weight, 0, safe.reshape(-1), False).view(safe.shape), 0.0)
         if weight is not None else pointwise_ops.where(valid, 1.0, 0.0).to(self.dtype))
    return valid, safe, w


def nll_loss_forward(self, target, weight, reduction, ignore_index):
    classes = self.dim() - 1 if self.dim() > 1 else 0
    _valid, safe, w = _nll_parts(self, target, weight, ignore_index)
    picked = take(self, classes, safe.unsqueeze(classes), True).squeeze(classes) if self.dim() > 1 else \
        take(self, 0, safe.reshape(1), False).reshape(())
    losses = OPS["neg"](pointwise_ops.mul(picked, w.to(self.dtype)))
    total = reductions.reduce(w, None, False, "sum", self.dtype)
    if reduction == 0:
        return losses, torch.zeros((), dtype=self.dtype, device=self.device)
    summed = reductions.reduce(losses, None, False, "sum")
    return (pointwise_ops.div(summed, total).to(self.dtype) if reduction == 1 else summed), total


def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    classes = self.dim() - 1 if self.dim() > 1 else 0
    _valid, safe, w = _nll_parts(self, target, weight, ignore_index)
    g = pointwise_ops.mul(OPS["neg"](w.to(torch.float32)), grad_output.float())
    if reduction == 1:
        g = pointwise_ops.div(g, total_weight.float())
    zero = torch.zeros_like(self)
    if self.dim() == 1:
        return put(zero, 0, safe.reshape(1), g.reshape(1).to(self.dtype), False, False)
    return put(zero, classes, safe.unsqueeze(classes), g.unsqueeze(classes).to(self.dtype), True, False)


def repeat_interleave(repeats, *, output_size=None):
    """`torch.repeat_interleave(repeats)`: i repeated repeats[i] times. A 1 is added at each row's end in a
    zero tensor (the add kernel), and the running sum of those is each position's row."""
    ends = scans.scan(repeats.reshape(-1), 0, False)
    total = output_size if output_size is not None else int(ends[-1].item()) if ends.numel() else 0
    marks = _full([total + 1], 0, dtype=torch.int64, device=repeats.device)
    if total:
        marks = put(marks, 0, ends, _full([ends.numel()], 1, dtype=torch.int64, device=repeats.device), False, True)
    return scans.scan(marks[:total], 0, False)


def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    """`torch.unique_consecutive`, of the flattened input or of the slices along `dim`: a run starts where an
    element (a slice) differs from the one before; the running count of starts is each one's run (`inverse`),
    the starts the output, and each run's length is counted by the add kernel."""
    along = dim is not None and self.dim() > 0
    d = dim % self.dim() if along else 0
    width = math.prod(size for i, size in enumerate(self.shape) if i != d)  # not -1: a size may be 0
    rows = self.movedim(d, 0).reshape(self.shape[d], width) if along else self.reshape(-1, 1)
    n = rows.shape[0]
    starts = _full([n], True, dtype=torch.bool, device=self.device)
    if n > 1 and rows.shape[1]:
        step = reductions.all_any(OPS["ne"](rows[1:], rows[:-1]), 1, False, True)
        OPS["copy"](step, out=starts[1:])
    elif n > 1:  # empty slices are all equal
        OPS["fill"](starts[1:], False, out=starts[1:])
    run = pointwise_ops.sub(scans.scan(starts, 0, False), 1)
    if along:
        output = take(self, d, nonzero(starts).reshape(-1), per_element=False)
    else:
        output = masked_select(self.reshape(-1), starts)
    groups = output.shape[d] if along else output.numel()
    counts = _full([groups], 0, dtype=torch.int64, device=self.device)
    if n:
        counts = put(counts, 0, run, _full([n], 1, dtype=torch.int64, device=self.device), False, True)
    empty = torch.empty(0, dtype=torch.int64, device=self.device)
    inverse = run if along else run.view(self.shape)
    return output, inverse if return_inverse else empty, counts if return_counts else empty


def select_backward(grad_output, input_sizes, dim, index):
    """The gradient of `x.select(dim, index)`: zeros, the row's gradient copied into its place."""
    out = _full(list(input_sizes), 0, dtype=grad_output.dtype, device=grad_output.device)
    if grad_output.numel():
        OPS["copy"](grad_output, out=out.select(dim, index))
    return out


# ATen's names of the floating dtypes in its overflow message.
_C_TYPES = {torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16", torch.float32: "float",
            torch.float64: "double"}


def _rounded(value: float, dtype: torch.dtype) -> float:
    """A Python number as `dtype` holds it: through float32 (as C++'s cast from double does), then to the nearest
    even 16-bit value for float16 and bfloat16."""
    if dtype == torch.float64:
        return float(value)
    single = struct.unpack("<f", struct.pack("<f", value))[0]
    if dtype == torch.float16:
        try:
            return struct.unpack("<e", struct.pack("<e", single))[0]
        except OverflowError:  # beyond float16's largest: infinite, as the cast makes it
            return math.copysign(math.inf, single)
    if dtype == torch.bfloat16 and math.isfinite(single):
        bits = struct.unpack("<I", struct.pack("<f", single))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    return single


def histc(self, bins=100, min=0, max=0):
    """`torch.histc`: each element's bin from its value (the top edge in the last bin, values outside left
    out), counted by the add kernel; min == max takes the data's own range. A range that is not finite or not
    increasing, and bins <= 0, are refused with ATen's words. As ATen does, the edges, the bin count and each step
    of `(x - lo) * bins / (hi - lo)` are in the input's dtype, so a 16-bit value on a bin boundary lands where
    PyTorch puts it."""
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    lo, hi = float(min), float(max)
    if lo == hi and self.numel():
        lo, hi = reductions.reduce(self, None, False, "min").item(), reductions.reduce(self, None, False, "max").item()
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise RuntimeError(f"torch.histc: range of [{lo:g}, {hi:g}] is not finite")
    if lo > hi:
        raise RuntimeError("torch.histc: max must be larger than min")
    limits = torch.finfo(self.dtype)
    if not limits.min <= lo <= hi <= limits.max:
        raise RuntimeError(f"value cannot be converted to type {_C_TYPES[self.dtype]} without overflow")
    lo, hi = _rounded(lo, self.dtype), _rounded(hi, self.dtype)
    flat = self.reshape(-1)
    inside = OPS["logical_and"](OPS["ge"](flat, lo), OPS["le"](flat, hi))
    scaled = pointwise_ops.mul(pointwise_ops.sub(flat, lo), _rounded(bins, self.dtype))
    scaled = pointwise_ops.div(scaled, _rounded(hi - lo, self.dtype))
    where = OPS["clamp"](OPS["trunc"](scaled), 0, bins - 1).to(torch.int64)
    counts = _full([bins + 1], 0, dtype=torch.float32, device=self.device)
    if flat.numel():  # the ones outside go to a spare bin past the end
        ones = _full([flat.numel()], 1.0, dtype=torch.float32, device=self.device)
        counts = put(counts, 0, pointwise_ops.where(inside, where, bins), ones, False, True)
    return counts[:bins].to(self.dtype)


def slice_backward(grad_output, input_sizes, dim, start, end, step):
    """The gradient of `x[..., start:end:step]`: zeros, the slice's gradient copied into its place."""
    out = _full(list(input_sizes), 0, dtype=grad_output.dtype, device=grad_output.device)
    index = [slice(None)] * len(input_sizes)
    index[dim] = slice(start, end, step)
    if grad_output.numel():
        OPS["copy"](grad_output, out=out[tuple(index)])
    return out


def _full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    if dtype is None:
        dtype = torch.bool if isinstance(fill_value, bool) else torch.int64 if isinstance(
            fill_value, int) else torch.get_default_dtype()
    out = torch.empty(size, dtype=dtype, device=device)
    return OPS["fill"](out, fill_value, out=out) if out.numel() else out


ATEN = {
    "index_select": lambda self, dim, index: take(self, dim, index, False),
    "gather": lambda self, dim, index, *, sparse_grad=False: gather(self, dim, index),
    "scatter.src": lambda self, dim, index, src: scatter(self, dim, index, src, False),
    "scatter.value": lambda self, dim, index, value: scatter(self, dim, index, value, False),
    "scatter_.value": lambda self, dim, index, value: scatter(self, dim, index, value, False, out=self),
    "scatter_.src": lambda self, dim, index, src: scatter(self, dim, index, src, False, out=self),
    "scatter_add": lambda self, dim, index, src: scatter(self, dim, index, src, True),
    "scatter_add_": lambda self, dim, index, src: scatter(self, dim, index, src, True, out=self),
    "index_add": lambda self, dim, index, source, *, alpha=1: put(
        self, dim, index, pointwise_ops.mul(source, alpha) if alpha != 1 else source, False, True),
    "index_add_": lambda self, dim, index, source, *, alpha=1: put(
        self, dim, index, pointwise_ops.mul(source, alpha) if alpha != 1 else source, False, True, out=self),
    "index_copy": lambda self, dim, index, source: put(self, dim, index, source, False, False),
    "index_put": index_put,
    "index_put_": lambda self, indices, values, accumulate=False: index_put(
        self, indices, values, accumulate, out=self),
    "masked_select": masked_select,
    "nonzero": nonzero,
    "cat": cat,
    "flip": flip,
    "repeat": repeat,
    "tril": lambda self, diagonal=0: triangle(self, diagonal, True),
    "tril_": lambda self, diagonal=0: triangle(self, diagonal, True, out=self),
    "triu": lambda self, diagonal=0: triangle(self, diagonal, False),
    "triu_": lambda self, diagonal=0: triangle(self, diagonal, False, out=self),
    "arange.start_step": arange,
    "arange.start": lambda start, end, *, dtype=None, layout=None, device=None, pin_memory=None: arange(
        start, end, 1, dtype=dtype, device=device),
    "arange": lambda end, *, dtype=None, layout=None, device=None, pin_memory=None: arange(
        0, end, 1, dtype=dtype, device=device),
    "full": _full,
    "zeros": lambda size, *, dtype=None, layout=None, device=None, pin_memory=None: _full(
        size, 0, dtype=dtype or torch.get_default_dtype(), device=device),
    "ones": lambda size, *, dtype=None, layout=None, device=None, pin_memory=None: _full(
        size, 1, dtype=dtype or torch.get_default_dtype(), device=device),
    "index.Tensor": index,
    "isin.Tensor_Tensor": isin,
    "masked_scatter": masked_scatter,
    "masked_scatter_": lambda self, mask, source: OPS["copy"](
        masked_scatter(self, mask, source), out=self),
    "masked_scatter_backward": masked_scatter_backward,
    "slice_backward": slice_backward,
    "histc": histc,
    "repeat_interleave.Tensor": repeat_interleave,
    "unique_consecutive": unique_consecutive,
    "select_backward": select_backward,
    "mse_loss": mse_loss, "mse_loss_backward": mse_loss_backward,
    "nll_loss_forward": nll_loss_forward, "nll_loss_backward": nll_loss_backward,
}
