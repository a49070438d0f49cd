"""embedding: rows of a weight gathered by index, and a backward that sums the gradient rows of each index
in a fixed order, so that the weight's gradient is the same bits on every run (no atomic adds).

The backward sorts the indices (stably) and gives each distinct index one program, which adds that index's
gradient rows one after another in fp32 and writes its row of the weight gradient once; rows no index
names stay zero, and so does `padding_idx`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.settings import warps

BLOCK_COLS = 1024  # columns of a row one program moves (a wider row takes several programs)


@triton.jit(do_not_specialize=["n_cols"])
def _embedding_fwd(weight, index, out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    source = tl.load(index + row).to(tl.int64)
    tl.store(out + row * n_cols + cols, tl.load(weight + source * n_cols + cols, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["n_cols"])
def _embedding_bwd(grad, order, starts, out, n_cols, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One distinct index: its gradient rows (positions order[starts[s]:starts[s + 1]]) summed in order."""
    segment = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    first = tl.load(starts + segment)
    last = tl.load(starts + segment + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(first, last):
        position = tl.load(order + i).to(tl.int64)
        acc += tl.load(grad + position * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALE:  # scale_grad_by_freq: divided by how often the index occurs in the batch
        acc = acc / (last - first).to(tl.float32)
    index_row = tl.load(starts + tl.num_programs(0) + 1 + segment).to(tl.int64)  # the index itself (see the table)
    tl.store(out + index_row * n_cols + cols, acc.to(out.dtype.element_ty), mask=mask)


def _forward(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    weight = weight.contiguous()
    flat = indices.reshape(-1).contiguous()
    n_cols = weight.shape[1]
    out = torch.empty(flat.numel(), n_cols, dtype=weight.dtype, device=weight.device)
    if out.numel():
        _embedding_fwd[(flat.numel(), triton.cdiv(n_cols, BLOCK_COLS))](weight, flat, out, n_cols, BLOCK=BLOCK_COLS,
                                                                        num_warps=warps(BLOCK_COLS))
    return out.view(*indices.shape, n_cols)


def _backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
              scale_grad_by_freq: bool) -> torch.Tensor:
    n_cols = grad.shape[-1]
    grad = grad.reshape(-1, n_cols).contiguous()
    flat = indices.reshape(-1)
    out = torch.zeros(num_weights, n_cols, dtype=grad.dtype, device=grad.device)
    if not flat.numel() or not n_cols:
        return out
    # Index bookkeeping (n integers): where each distinct index's positions start in the stable order.
    values, order = torch.sort(flat, stable=True)
    distinct, counts = torch.unique_consecutive(values, return_counts=True)
    starts = torch.zeros(distinct.numel() + 1, dtype=torch.int64, device=grad.device)
    torch.cumsum(counts, 0, out=starts[1:])
    # One table: the segment starts, then the index of each segment.
    table = torch.cat([starts, distinct.to(torch.int64)])
    _embedding_bwd[(distinct.numel(), triton.cdiv(n_cols, BLOCK_COLS))](
        grad, order, table, out, n_cols, SCALE=bool(scale_grad_by_freq), BLOCK=BLOCK_COLS,
        num_warps=warps(BLOCK_COLS))
    if padding_idx >= 0:
        out[padding_idx] = 0
    return out


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, indices, padding_idx, scale_grad_by_freq):
        ctx.save_for_backward(indices)
        ctx.args = (weight.shape[0], padding_idx, scale_grad_by_freq)
        return _forward(weight, indices)

    @staticmethod
    def backward(ctx, g):
        (indices,) = ctx.saved_tensors
        return _backward(g, indices, *ctx.args), None, None, None


def embedding(indices: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None,
              scale_grad_by_freq: bool = False) -> torch.Tensor:
    """`F.embedding(indices, weight)`: rows of `weight` (num, dim) by integer `indices` of any shape; the
    weight's gradient is deterministic. `padding_idx`'s row gets no gradient."""
    if weight.dim() != 2:
        raise ValueError(f"weight {tuple(weight.shape)}: give (num_embeddings, embedding_dim)")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"indices are {indices.dtype}: give an integer tensor")
    pad = -1 if padding_idx is None else padding_idx % weight.shape[0]
    return _Embedding.apply(weight, indices, pad, scale_grad_by_freq)
