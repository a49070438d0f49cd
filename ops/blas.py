"""addmm: beta * bias + alpha * (mat1 @ mat2), forward and backward with one tiled Triton matmul kernel.

The kernel takes strides, so transposed operands in the backward (g @ mat2ᵀ, mat1ᵀ @ g) cost no copy;
it accumulates in fp32 and adds a broadcast bias (stride 0 along broadcast dimensions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _matmul(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn, sbm, sbn2, alpha, beta,
            HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a_mask = (rm[:, None] < M) & ((k + rk)[None, :] < K)
        b_mask = ((k + rk)[:, None] < K) & (rn[None, :] < N)
        a = tl.load(a_ptr + rm[:, None] * sam + (k + rk)[None, :] * sak, mask=a_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + (k + rk)[:, None] * sbk + rn[None, :] * sbn, mask=b_mask, other=0.0).to(tl.float32)
        acc += tl.dot(a, b, input_precision="ieee")
    acc = acc * alpha
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rm[:, None] * sbm + rn[None, :] * sbn2, mask=c_mask, other=0.0).to(tl.float32)
        acc += beta * bias
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _blocks(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """Tile sizes from the shape: large tiles for large GPU matmuls, small ones for small or interpreted."""
    if device.type != "cuda":
        return 32, 32, 32
    big = 128 if min(m, n) >= 2048 else 64
    return min(big, max(16, triton.next_power_of_2(m))), min(big, max(16, triton.next_power_of_2(n))), \
        min(64, max(16, triton.next_power_of_2(k)))


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, alpha: float = 1.0,
           beta: float = 1.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """alpha * (a @ b) + beta * bias for 2-D a (M, K), b (K, N); bias broadcastable to (M, N)."""
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"mat1 {tuple(a.shape)} and mat2 {tuple(b.shape)} cannot be multiplied")
    c = torch.empty((m, n), dtype=out_dtype or a.dtype, device=a.device)
    bias_full = bias.expand(m, n) if bias is not None else c
    bm, bn, bk = _blocks(m, n, k, a.device)
    if c.numel():
        _matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            a, b, c, bias_full, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
            c.stride(1), bias_full.stride(0), bias_full.stride(1), float(alpha), float(beta),
            HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk)
    return c


def _sum_to(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a (M, N) gradient down to a broadcast operand's shape."""
    while g.dim() > len(shape):
        g = g.sum(0)
    for i, size in enumerate(shape):
        if size == 1 and g.shape[i] != 1:
            g = g.sum(i, keepdim=True)
    return g


class _Addmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, mat1, mat2, beta, alpha):
        ctx.save_for_backward(mat1, mat2)
        ctx.args = (beta, alpha, bias.shape, bias.dtype)
        return matmul(mat1, mat2, bias, alpha, beta)

    @staticmethod
    def backward(ctx, g):
        mat1, mat2 = ctx.saved_tensors
        beta, alpha, bias_shape, bias_dtype = ctx.args
        g1 = matmul(g, mat2.t(), alpha=alpha, out_dtype=mat1.dtype) if ctx.needs_input_grad[1] else None
        g2 = matmul(mat1.t(), g, alpha=alpha, out_dtype=mat2.dtype) if ctx.needs_input_grad[2] else None
        gb = (_sum_to(g.float(), bias_shape) * beta).to(bias_dtype) if ctx.needs_input_grad[0] else None
        return gb, g1, g2, None, None


def addmm(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, beta: float = 1, alpha: float = 1):
    """`torch.addmm`: beta * bias + alpha * (mat1 @ mat2)."""
    return _Addmm.apply(bias, mat1, mat2, float(beta), float(alpha))
