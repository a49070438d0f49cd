"""Cross-entropy, and fused linear cross-entropy that never materialises the logits (Liger-Kernel's).

One program handles one row of logits in blocks of the vocabulary: an online max and sum give the
log-sum-exp, then the loss (with `ignore_index` and `label_smoothing`, as `F.cross_entropy`); a second
kernel writes the gradient softmax(x) - target distribution, scaled. The fused op computes the logits of
a chunk of rows at a time, takes their loss and gradient in place, and folds that into the gradients of
the hidden states and the weight before moving on, so its memory is one chunk of logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _ce_loss(x_ptr, stride, target_ptr, loss_ptr, lse_ptr, n_cols, ignore_index, smoothing,
             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    target = tl.load(target_ptr + row)
    m = -float("inf")
    s = 0.0
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        total += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = m + tl.log(s)
    ignored = target == ignore_index
    x_t = tl.load(base + tl.where(ignored, 0, target)).to(tl.float32)
    loss = (1.0 - smoothing) * (lse - x_t) + smoothing * (lse - total / n_cols)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_grad(x_ptr, stride, grad_ptr, gstride, target_ptr, lse_ptr, scale_ptr, n_cols, ignore_index, smoothing,
             PER_ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row) if PER_ROW_SCALE else tl.load(scale_ptr)
    scale = tl.where(target == ignore_index, 0.0, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        g = p - smoothing / n_cols - tl.where(cols == target, 1.0 - smoothing, 0.0)
        tl.store(grad_ptr + row * gstride + cols, (g * scale).to(grad_ptr.dtype.element_ty), mask=mask)


def _rows_loss(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float):
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _ce_loss[(rows,)](logits, logits.stride(0), target, loss, lse, vocab, ignore_index, smoothing,
                          BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)))
    return loss, lse


def _rows_grad(logits, target, lse, scale, ignore_index, smoothing, out):
    rows, vocab = logits.shape
    if rows:
        _ce_grad[(rows,)](logits, logits.stride(0), out, out.stride(0), target, lse, scale, vocab, ignore_index,
                          smoothing, PER_ROW_SCALE=scale.numel() > 1, BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)))
    return out


def _reduce(loss: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / count


def _check(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'")


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, smoothing):
        logits = logits.contiguous()
        target = target.contiguous()
        loss, lse = _rows_loss(logits, target, ignore_index, smoothing)
        count = (target != ignore_index).sum().clamp(min=1).to(torch.float32)
        ctx.save_for_backward(logits, target, lse, count)
        ctx.args = (ignore_index, reduction, smoothing)
        return _reduce(loss, count, reduction).to(logits.dtype)

    @staticmethod
    def backward(ctx, g):
        logits, target, lse, count = ctx.saved_tensors
        ignore_index, reduction, smoothing = ctx.args
        g = g.float()
        scale = g.contiguous() if reduction == "none" else (g / count if reduction == "mean" else g).reshape(1)
        grad = _rows_grad(logits, target, lse, scale.contiguous(), ignore_index, smoothing, torch.empty_like(logits))
        return grad, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """`torch.nn.functional.cross_entropy` over class logits: (N, C) with target (N,), or (N, C, d...) with
    target (N, d...)."""
    _check(reduction)
    shape = target.shape
    if logits.dim() > 2:
        logits = logits.movedim(1, -1).reshape(-1, logits.shape[1])
        target = target.reshape(-1)
    out = _CrossEntropy.apply(logits, target, ignore_index, reduction, float(label_smoothing))
    return out.view(shape) if reduction == "none" else out


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, reduction, chunk_rows):
        rows = hidden.shape[0]
        target = target.contiguous()
        count = (target != ignore_index).sum().clamp(min=1).to(torch.float32)
        scale = (1.0 / count if reduction == "mean" else torch.ones((), device=hidden.device)).reshape(1)
        loss = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = (torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
                     if bias is not None else None)
        for start in range(0, rows, chunk_rows):
            h = hidden[start:start + chunk_rows]
            t = target[start:start + chunk_rows]
            logits = h @ weight.t()
            if bias is not None:
                logits += bias
            part, lse = _rows_loss(logits, t, ignore_index, 0.0)
            loss[start:start + chunk_rows] = part
            # The chunk's logits are not needed again: their gradient overwrites them.
            _rows_grad(logits, t, lse, scale.float().contiguous(), ignore_index, 0.0, logits)
            grad_hidden[start:start + chunk_rows] = logits @ weight
            grad_weight += logits.t().float() @ h.float()
            if grad_bias is not None:
                grad_bias += logits.float().sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.reduction = reduction
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return _reduce(loss, count, reduction).to(hidden.dtype)

    @staticmethod
    def backward(ctx, g):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        g = g.float()
        gh = grad_hidden * g.to(grad_hidden.dtype)
        gw = (grad_weight * g).to(ctx.dtypes[0])
        gb = (grad_bias * g).to(ctx.dtypes[1]) if grad_bias is not None else None
        return gh, gw, None, gb, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               reduction: str = "mean", chunk_rows: int = 1024) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target) without materialising the logits. hidden: (..., H),
    weight: (V, H), target: (...). Reductions `mean` and `sum` (the gradients are computed in forward)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: the fused op computes gradients in forward, for 'mean' or 'sum'")
    return _FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias,
                                          ignore_index, reduction, chunk_rows)
