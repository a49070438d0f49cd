"""The matmul family of the linear layers: addmm (beta * bias + alpha * (mat1 @ mat2)), mm and bmm, forward
and backward with one tiled Triton matmul kernel (a batched product is the grid's second axis).

The kernel takes strides, so transposed operands in the backward (g @ mat2ᵀ, mat1ᵀ @ g) cost no copy.
bf16/fp16 operands run on the tensor cores with fp32 accumulation; fp32 operands use TF32 exactly when
`torch.backends.cuda.matmul.allow_tf32` allows it. A broadcast bias is read with stride 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.settings import matmul_settings


@triton.jit
def _matmul(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn, sbm, sbn2, alpha, beta,
            sab, sbb, scb, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # Programs walk the output in groups of GROUP_M tile rows, so that the tiles running together share
    # their rows of `a` and columns of `b` in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    batch = tl.program_id(1).to(tl.int64)
    a_ptr += batch * sab
    b_ptr += batch * sbb
    c_ptr += batch * scb
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None] * sam + rk[None, :] * sak
    b_ptrs = b_ptr + rk[:, None] * sbk + rn[None, :] * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_ptrs, mask=rn[None, :] < N, other=0.0)
        else:
            k_left = K - k * BK
            a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        # bf16/fp16 tiles go to the tensor cores as they are, accumulating in fp32; fp32 tiles use TF32
        # or full fp32 as PRECISION says.
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BK * sak
        b_ptrs += BK * sbk
    acc = acc * alpha
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rm[:, None] * sbm + rn[None, :] * sbn2, mask=c_mask, other=0.0).to(tl.float32)
        acc += beta * bias
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _precision(dtype: torch.dtype) -> str:
    """fp32 products use TF32 exactly when PyTorch's own matmuls would."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, alpha: float = 1.0,
           beta: float = 1.0, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """alpha * (a @ b) + beta * bias for a (M, K), b (K, N) of one dtype, bias broadcastable to (M, N); or a
    batched product of a (B, M, K) and b (B, K, N), without bias. `out`: the (M, N) result's tensor, any
    strides, which may be `bias` itself (each element is read and written by the same program: how
    `addmm_` and `mm.out` run)."""
    batched = a.dim() == 3
    if a.dim() != b.dim() or a.dim() not in (2, 3) or (batched and (bias is not None or a.shape[0] != b.shape[0])):
        raise ValueError(f"mat1 {tuple(a.shape)} and mat2 {tuple(b.shape)}: give two matrices, or two batches of "
                         "as many matrices (without bias)")
    (m, k), (k2, n) = a.shape[-2:], b.shape[-2:]
    if k != k2:
        raise ValueError(f"mat1 {tuple(a.shape)} and mat2 {tuple(b.shape)} cannot be multiplied")
    if a.dtype != b.dtype:
        raise ValueError(f"mat1 ({a.dtype}) and mat2 ({b.dtype}) must have the same dtype")
    batch = a.shape[0] if batched else 1
    shape = (*a.shape[:-2], m, n)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out {tuple(out.shape)}: the product of mat1 {tuple(a.shape)} and mat2 {tuple(b.shape)} "
                         f"is {shape}")
    c = out if out is not None else torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)
    bias_full = bias.expand(m, n) if bias is not None else a.new_empty(0, 0)  # never read without a bias
    if c.numel():
        meta = matmul_settings(m, n, k, a.dtype)
        grid = (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]), batch)
        sa, sb, sc = (t.stride(0) if batched else 0 for t in (a, b, c))
        _matmul[grid](a, b, c, bias_full, m, n, k, a.stride(-2), a.stride(-1), b.stride(-2), b.stride(-1),
                      c.stride(-2), c.stride(-1), bias_full.stride(0), bias_full.stride(1), float(alpha), float(beta),
                      sa, sb, sc, HAS_BIAS=bias is not None and beta != 0, PRECISION=_precision(a.dtype),
                      EVEN_K=k % meta["BK"] == 0, **meta)
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


class _Mm(torch.autograd.Function):
    """mm (2-D) or bmm (3-D): the backward's products read the operands transposed, through strides."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return matmul(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = matmul(g, b.transpose(-1, -2), out_dtype=a.dtype) if ctx.needs_input_grad[0] else None
        gb = matmul(a.transpose(-1, -2), g, out_dtype=b.dtype) if ctx.needs_input_grad[1] else None
        return ga, gb


def mm(mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """`torch.mm`: mat1 (M, K) @ mat2 (K, N)."""
    if mat1.dim() != 2 or mat2.dim() != 2:
        raise ValueError(f"mm takes two matrices, got {tuple(mat1.shape)} and {tuple(mat2.shape)}")
    return _Mm.apply(mat1, mat2)


def bmm(batch1: torch.Tensor, batch2: torch.Tensor) -> torch.Tensor:
    """`torch.bmm`: batch1 (B, M, K) @ batch2 (B, K, N), matrix by matrix."""
    if batch1.dim() != 3 or batch2.dim() != 3:
        raise ValueError(f"bmm takes two batches of matrices, got {tuple(batch1.shape)} and {tuple(batch2.shape)}")
    return _Mm.apply(batch1, batch2)
