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

from ops.settings import MAX_ROW_BLOCK, warps

# The fused op's logits of one chunk take at most this share of the weight's size, and at least
# MIN_CHUNK_BYTES: few chunks keep the weight gradient's read-modify-write cheap, a small share keeps
# the peak memory near the weight gradient's own.
CHUNK_SHARE = 8
MIN_CHUNK_BYTES = 64 * 2**20


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
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a block of -inf so far: no NaN from inf - inf
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
        total += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = m + tl.log(s)
    ignored = target == ignore_index
    # A target outside [0, n_cols) reads column 0 rather than past the row (PyTorch raises there).
    x_t = tl.load(base + tl.where(ignored | (target < 0) | (target >= n_cols), 0, target)).to(tl.float32)
    # The smoothing term only where smoothing is on: 0 * inf (a row with -inf logits) would be NaN.
    loss = (1.0 - smoothing) * (lse - x_t) + tl.where(smoothing > 0, smoothing * (lse - total / n_cols), 0.0)
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


def _block(vocab: int) -> dict:
    block = min(MAX_ROW_BLOCK, triton.next_power_of_2(max(1, vocab)))
    return {"BLOCK": block, "num_warps": warps(block)}


def _rows_loss(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float):
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows and vocab:
        _ce_loss[(rows,)](logits, logits.stride(0), target, loss, lse, vocab, ignore_index, smoothing,
                          **_block(vocab))
    return loss, lse


def _rows_grad(logits, target, lse, scale, ignore_index, smoothing, out):
    rows, vocab = logits.shape
    if rows and vocab:
        _ce_grad[(rows,)](logits, logits.stride(0), out, out.stride(0), target, lse, scale, vocab, ignore_index,
                          smoothing, PER_ROW_SCALE=scale.numel() > 1, **_block(vocab))
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


def _chunk_rows(hidden: torch.Tensor, weight: torch.Tensor) -> int:
    budget = max(weight.numel() * weight.element_size() // CHUNK_SHARE, MIN_CHUNK_BYTES)
    return max(1, budget // (weight.shape[0] * hidden.element_size()))


def _accumulate(grad_weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """grad_weight += a @ b, accumulating in fp32, whatever grad_weight's dtype."""
    if grad_weight.dtype == a.dtype:
        grad_weight.addmm_(a, b)
    elif grad_weight.is_cuda and hasattr(torch.ops.aten.addmm, "dtype_out"):
        torch.addmm(grad_weight, a, b, out_dtype=grad_weight.dtype, out=grad_weight)
    else:
        grad_weight.add_(a @ b)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger-Kernel's layout: per chunk of rows, the logits by cuBLAS in the compute dtype, their loss and
    gradient by our kernels (the gradient overwrites the logits), then cuBLAS folds that gradient into
    the hidden states' gradient and accumulates the weight's, in the weight's dtype. The gradients are
    complete after forward; backward scales them by the incoming gradient.

    The compute dtype is autocast's when autocast is on (as `F.linear` would run), else the hidden
    states'; the body runs with autocast off, so every matmul and its output buffer agree on it."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, reduction, chunk_rows):
        device = hidden.device.type
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        with torch.autocast(device, enabled=False):
            h_all, w = hidden.to(compute), weight.to(compute)
            b = bias.to(compute) if bias is not None else None
            rows = h_all.shape[0]
            target = target.contiguous()
            count = (target != ignore_index).sum().clamp(min=1).to(torch.float32)
            scale = (1.0 / count if reduction == "mean" else torch.ones((), device=hidden.device)).reshape(1)
            loss = torch.empty(rows, dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(h_all)
            grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
            grad_bias = (torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
                         if bias is not None and ctx.needs_input_grad[3] else None)
            step = chunk_rows or _chunk_rows(h_all, w)
            for start in range(0, rows, step):
                end = min(rows, start + step)
                h, t = h_all[start:end], target[start:end]
                logits = h @ w.t() if b is None else torch.addmm(b, h, w.t())
                part, lse = _rows_loss(logits, t, ignore_index, 0.0)
                loss[start:end] = part
                _rows_grad(logits, t, lse, scale, ignore_index, 0.0, logits)  # the logits become their gradient
                torch.mm(logits, w, out=grad_hidden[start:end])
                if grad_weight is not None:
                    _accumulate(grad_weight, logits.t(), h)
                if grad_bias is not None:
                    grad_bias += logits.sum(0, dtype=torch.float32)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, bias.dtype if bias is not None else None)
        out_dtype = torch.float32 if compute != hidden.dtype else hidden.dtype  # autocast's losses are fp32
        return _reduce(loss, count, reduction).to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy computes its gradients once: a second backward "
                               "through the same call (retain_graph) is not supported")
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None  # scaled in place below, so they must never be used again
        hidden_dtype, bias_dtype = ctx.dtypes
        g = g.float()
        gh = grad_hidden.mul_(g.to(grad_hidden.dtype)).to(hidden_dtype)
        gw = grad_weight.mul_(g.to(grad_weight.dtype)) if grad_weight is not None else None
        gb = (grad_bias * g).to(bias_dtype) if grad_bias is not None else None
        return gh, gw, None, gb, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               reduction: str = "mean", chunk_rows: int | None = None) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target) without materialising the logits. hidden: (..., H),
    weight: (V, H), target: (...). Reductions `mean` and `sum` (the gradients are computed in forward).
    `chunk_rows` rows of logits exist at a time (default: chosen from the weight's size)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: the fused op computes gradients in forward, for 'mean' or 'sum'")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows}: give a positive number of rows, or None to choose")
    return _FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias,
                                          ignore_index, reduction, chunk_rows)
