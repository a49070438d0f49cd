"""scaled_dot_product_attention: a FlashAttention-2 style forward and backward in Triton.

The forward walks the keys block by block with an online softmax (a running max and sum per query row),
so no (seq, seq) matrix is ever in memory, and saves each row's log-sum-exp for the backward. The
backward recomputes the probabilities from it: one kernel per key block accumulates dK and dV over every
query head of its group (grouped-query heads read their shared K/V head; nothing is repeated, nothing is
added atomically, so the gradients are deterministic), another per query block accumulates dQ.

Masks: `is_causal` (top-left aligned, as PyTorch's) and `attn_mask` given as document ids (batch, seq):
a query sees only the keys of its own document, what packed rows (`data.packing=true`) need; both
together give causal attention within each document. Head dims up to 256 are padded to a power of two
in registers (80 and 96 run in 128-wide tiles, masked). bf16/fp16 tiles go to the tensor cores with fp32
accumulation; fp32 tiles use TF32 exactly when `torch.backends.cuda.matmul.allow_tf32` allows it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ops.blas import _precision

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


# The masks and sizes are runtime arguments, not specialised: one compiled kernel per dtype and padded
# head dim serves causal or not, documents or not, any length and any head grouping; EVEN_D (a head dim
# that fills its tile) drops the head-dim mask so that loads stay vectorised.
RUNTIME = ["Sq", "Sk", "heads", "group", "causal", "documents", "sdb", "head_dim"]


@triton.jit
def _visible(rows, cols, Sq, Sk, doc_q, doc_k, causal):
    """Which (query row, key column) pairs of a tile take part: inside both sequences, and the masks
    (without documents both ids are 0 everywhere)."""
    ok = (rows[:, None] < Sq) & (cols[None, :] < Sk) & (doc_q[:, None] == doc_k[None, :])
    return ok & ((cols[None, :] <= rows[:, None]) | (causal == 0))


@triton.jit
def _head_mask(offs_d, head_dim, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr):
    if EVEN_D:
        return tl.full([BLOCK_D], 1, tl.int1)
    return offs_d < head_dim


@triton.jit
def _documents(DOCS, index, ok, documents):
    """Document ids of these rows (or columns), 0 where there are none."""
    return tl.load(DOCS + index, mask=(ok.to(tl.int32) * documents) != 0, other=0)


@triton.jit
def _program(heads, group, head_dim, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    """What this program works on: its block of rows (queries, or keys for the dK/dV kernel, whose
    `heads` counts the K/V heads and `group` is 1), its batch, head and K/V head, and the head-dim
    offsets with their mask."""
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    return bh, b, h, h // group, rows, offs_d, _head_mask(offs_d, head_dim, EVEN_D, BLOCK_D)


@triton.jit
def _causal_end(Sk, start_m, causal, BM: tl.constexpr):
    """Where the key blocks one block of query rows sees end: past its last row they are all masked."""
    hi = Sk
    if causal != 0:
        hi = tl.minimum(Sk, (start_m + 1) * BM)
    return hi


@triton.jit(do_not_specialize=RUNTIME)
def _attn_fwd(Q, K, V, OUT, LSE, DOCS, scale_log2, Sq, Sk, heads, group, causal, documents,
              sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, sdb, head_dim,
              EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              PRECISION: tl.constexpr):
    start_m = tl.program_id(0)
    bh, b, h, kvh, rows, offs_d, d_ok = _program(heads, group, head_dim, EVEN_D, BLOCK_D, BM)
    offs_n = tl.arange(0, BN)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd,
                mask=(rows[:, None] < Sq) & d_ok[None, :], other=0.0)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    doc_q = _documents(DOCS, b * sdb + rows, rows < Sq, documents)
    m_i = tl.full([BM], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, _causal_end(Sk, start_m, causal, BM), BN):
        cols = start_n + offs_n
        kt = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd,
                     mask=(cols[None, :] < Sk) & d_ok[:, None], other=0.0)
        doc_k = _documents(DOCS, b * sdb + cols, cols < Sk, documents)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
        s = tl.where(_visible(rows, cols, Sq, Sk, doc_q, doc_k, causal), s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen only masked keys so far subtract 0: no NaN from -inf - -inf.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :] * svd,
                    mask=(cols[:, None] < Sk) & d_ok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(OUT + b * sob + h * soh + rows[:, None] * som + offs_d[None, :] * sod, out.to(OUT.dtype.element_ty),
             mask=(rows[:, None] < Sq) & d_ok[None, :])
    # log2 of the row's softmax denominator, in the scaled base-2 domain the backward recomputes in.
    tl.store(LSE + bh.to(tl.int64) * Sq + rows, m_i + tl.log2(l_safe), mask=rows < Sq)


@triton.jit(do_not_specialize=["Sq", "heads", "head_dim"])
def _attn_delta(OUT, DO, DELTA, Sq, heads, sob, soh, som, sod, sgb, sgh, sgm, sgd, head_dim, EVEN_D: tl.constexpr,
                BLOCK_D: tl.constexpr, BM: tl.constexpr):
    """delta = rowsum(dO * O), the softmax backward's correction term, one value per query row."""
    bh, b, h, _, rows, offs_d, d_ok = _program(heads, 1, head_dim, EVEN_D, BLOCK_D, BM)
    mask = (rows[:, None] < Sq) & d_ok[None, :]
    o = tl.load(OUT + b * sob + h * soh + rows[:, None] * som + offs_d[None, :] * sod, mask=mask, other=0.0)
    g = tl.load(DO + b * sgb + h * sgh + rows[:, None] * sgm + offs_d[None, :] * sgd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * g.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * Sq + rows, delta, mask=rows < Sq)


@triton.jit(do_not_specialize=RUNTIME)
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DOCS, DK, DV, scale, scale_log2, Sq, Sk, heads, group, causal,
                   documents, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgm, sgd,
                   sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, sdb, head_dim,
                   EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   PRECISION: tl.constexpr):
    """dK and dV of one block of keys of one K/V head, summed over the query heads of its group
    (`heads` here counts the K/V heads)."""
    start_n = tl.program_id(0)
    _, b, kvh, _, cols, offs_d, d_ok = _program(heads, 1, head_dim, EVEN_D, BLOCK_D, BN)
    offs_m = tl.arange(0, BM)
    kv_mask = (cols[:, None] < Sk) & d_ok[None, :]
    k = tl.load(K + b * skb + kvh * skh + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + kvh * svh + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    doc_k = _documents(DOCS, b * sdb + cols, cols < Sk, documents)
    dk = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
    lo = 0
    if causal != 0:  # query rows before this block's first key see none of it
        lo = (start_n * BN // BM) * BM
    for g in range(0, group):
        h = kvh * group + g
        row_base = (b * (heads * group) + h) * Sq
        for start_m in range(lo, Sq, BM):
            rows = start_m + offs_m
            row_ok = rows < Sq
            qt = tl.load(Q + b * sqb + h * sqh + rows[None, :] * sqm + offs_d[:, None] * sqd,
                         mask=row_ok[None, :] & d_ok[:, None], other=0.0)
            do = tl.load(DO + b * sgb + h * sgh + rows[:, None] * sgm + offs_d[None, :] * sgd,
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(LSE + row_base + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
            doc_q = _documents(DOCS, b * sdb + rows, row_ok, documents)
            # Transposed tiles (keys x queries): the products below then need no transpose of k or v.
            st = tl.dot(k, qt, input_precision=PRECISION) * scale_log2
            visible = tl.trans(_visible(rows, cols, Sq, Sk, doc_q, doc_k, causal))
            pt = tl.where(visible, tl.exp2(st - lse[None, :]), 0.0)
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dst = pt * (dpt - delta[None, :])
            dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
    tl.store(DK + b * sdkb + kvh * sdkh + cols[:, None] * sdkn + offs_d[None, :] * sdkd,
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + kvh * sdvh + cols[:, None] * sdvn + offs_d[None, :] * sdvd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=RUNTIME)
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DOCS, DQ, scale, scale_log2, Sq, Sk, heads, group, causal, documents,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgm, sgd,
                 sdqb, sdqh, sdqm, sdqd, sdb, head_dim,
                 EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 PRECISION: tl.constexpr):
    """dQ of one block of query rows of one head."""
    start_m = tl.program_id(0)
    bh, b, h, kvh, rows, offs_d, d_ok = _program(heads, group, head_dim, EVEN_D, BLOCK_D, BM)
    offs_n = tl.arange(0, BN)
    row_ok = rows < Sq
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
    do = tl.load(DO + b * sgb + h * sgh + rows[:, None] * sgm + offs_d[None, :] * sgd, mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * Sq + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * Sq + rows, mask=row_ok, other=0.0)
    doc_q = _documents(DOCS, b * sdb + rows, row_ok, documents)
    dq = tl.zeros([BM, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, _causal_end(Sk, start_m, causal, BM), BN):
        cols = start_n + offs_n
        col_ok = cols < Sk
        kt = tl.load(K + b * skb + kvh * skh + cols[None, :] * skn + offs_d[:, None] * skd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        vt = tl.load(V + b * svb + kvh * svh + cols[None, :] * svn + offs_d[:, None] * svd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        doc_k = _documents(DOCS, b * sdb + cols, col_ok, documents)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
        p = tl.where(_visible(rows, cols, Sq, Sk, doc_q, doc_k, causal), tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)
    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqm + offs_d[None, :] * sdqd,
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def _settings(block_d: int, dtype: torch.dtype, backward: bool) -> dict:
    """Tiles, warps and stages from the padded head dim and dtype only (never the sequence length), so
    that a test's tiny launch is the very specialisation a GPU runs at full length. 16-bit tiles follow
    Triton's fused-attention tutorial for Hopper and Ampere; fp32 tiles are halved to fit sm_80's
    shared memory."""
    wide = dtype.itemsize == 2
    if backward:
        bm, bn = (64, 64) if wide else (32, 32)
        if block_d > 128:
            bm, bn = bm // 2, bn // 2
        return {"BM": bm, "BN": bn, "num_warps": 8 if block_d >= 128 else 4, "num_stages": 2 if wide else 1}
    bm, bn = (128, 64) if wide else (64, 32)
    if block_d > 128:
        bm, bn = bm // 2, bn // 2
    return {"BM": bm, "BN": bn, "num_warps": 8 if block_d >= 128 else 4, "num_stages": 3 if wide else 2}


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _docs(documents: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, int]:
    """The document ids and their row stride; without any, a one-element stand-in the kernels never read."""
    if documents is None:
        return torch.zeros(1, dtype=torch.int32, device=device), 0
    return documents, documents.stride(0)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents, causal, scale):
        batch, heads, sq, head_dim = q.shape
        kv_heads, sk = k.shape[1], k.shape[2]
        # (batch, seq, heads, dim) memory seen as (batch, heads, seq, dim): what the model reshapes next.
        o = torch.empty(batch, sq, heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(batch, heads, sq, dtype=torch.float32, device=q.device)
        block_d = max(16, triton.next_power_of_2(head_dim))
        docs, doc_stride = _docs(documents, q.device)
        meta = _settings(block_d, q.dtype, backward=False)
        if o.numel():
            grid = (triton.cdiv(sq, meta["BM"]), batch * heads)
            _attn_fwd[grid](q, k, v, o, lse, docs, scale * LOG2E, sq, sk, heads, heads // kv_heads, int(causal),
                            int(documents is not None), *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                            doc_stride, head_dim, EVEN_D=head_dim == block_d, BLOCK_D=block_d,
                            PRECISION=_precision(q.dtype), **meta)
        ctx.save_for_backward(q, k, v, o, lse, documents)
        ctx.args = (causal, scale, block_d)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, documents = ctx.saved_tensors
        causal, scale, block_d = ctx.args
        batch, heads, sq, head_dim = q.shape
        kv_heads, sk = k.shape[1], k.shape[2]
        group = heads // kv_heads
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if not (q.numel() and k.numel()):
            return dq.zero_(), dk.zero_(), dv.zero_(), None, None, None
        docs, doc_stride = _docs(documents, q.device)
        delta = torch.empty_like(lse)
        meta = _settings(block_d, q.dtype, backward=True)
        masks = (int(causal), int(documents is not None))
        common = dict(EVEN_D=head_dim == block_d, BLOCK_D=block_d, PRECISION=_precision(q.dtype), **meta)
        _attn_delta[(triton.cdiv(sq, meta["BM"]), batch * heads)](
            o, do, delta, sq, heads, *_strides(o), *_strides(do), head_dim, EVEN_D=head_dim == block_d,
            BLOCK_D=block_d, BM=meta["BM"], num_warps=4)
        operands = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
        _attn_bwd_dkdv[(triton.cdiv(sk, meta["BN"]), batch * kv_heads)](
            q, k, v, do, lse, delta, docs, dk, dv, scale, scale * LOG2E, sq, sk, kv_heads, group, *masks, *operands,
            *_strides(dk), *_strides(dv), doc_stride, head_dim, **common)
        _attn_bwd_dq[(triton.cdiv(sq, meta["BM"]), batch * heads)](
            q, k, v, do, lse, delta, docs, dq, scale, scale * LOG2E, sq, sk, heads, group, *masks, *operands,
            *_strides(dq), doc_stride, head_dim, **common)
        return dq, dk, dv, None, None, None


def _check(q, k, v, attn_mask, dropout_p, enable_gqa) -> None:
    """A clear error for what this op does not take, before any kernel runs."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: give (batch, heads, seq, head_dim)")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name} is {t.dtype}: the kernels take float32, bfloat16 or float16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}: key and value "
                         "must match, and share batch and head_dim with query")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {q.shape[3]}: at most {MAX_HEAD_DIM}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"{q.shape[1]} query heads and {k.shape[1]} key/value heads need enable_gqa=True")
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: the kernels have no attention dropout; use 0")
    if attn_mask is not None:
        if attn_mask.dtype.is_floating_point or attn_mask.dtype == torch.bool or attn_mask.dim() != 2:
            raise ValueError(f"attn_mask {attn_mask.dtype} {tuple(attn_mask.shape)}: give document ids, an "
                             "integer tensor (batch, seq); a query sees the keys of its own document")
        if tuple(attn_mask.shape) != (q.shape[0], q.shape[2]) or q.shape[2] != k.shape[2]:
            raise ValueError(f"attn_mask {tuple(attn_mask.shape)}: document ids need (batch, seq) = "
                             f"{(q.shape[0], q.shape[2])} and as many keys as queries ({k.shape[2]})")


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for query (batch, heads, seq_q, head_dim) and key/value (batch,
    kv_heads, seq_k, head_dim), any strides. `attn_mask`: None, or document ids (batch, seq) of any
    integer dtype: attention stays within each document (with `is_causal`, causal within it). `scale`
    defaults to 1/sqrt(head_dim)."""
    _check(query, key, value, attn_mask, dropout_p, enable_gqa)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    documents = attn_mask.to(device=query.device, dtype=torch.int32).contiguous() if attn_mask is not None else None
    return _Attention.apply(query, key, value, documents, bool(is_causal), scale)


def _math_probabilities(q, k, attn_mask, is_causal, scale):
    """fp32 scores of (batch, heads, seq_q, seq_k) with the masks applied, their log-sum-exp, the probabilities
    (0 where a row sees no key), in routed ATen ops; K's heads repeated for grouped queries."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    kf = k.float()
    if group > 1:
        kf = kf.repeat_interleave(group, 1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if is_causal:
        seen = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(seen.logical_not(), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(attn_mask.logical_not(), float("-inf")) if attn_mask.dtype == torch.bool else \
            s + attn_mask.float()
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p, lse, kf, scale, group


def _grouped(t, group, heads):
    """A gradient of repeated K/V heads summed back onto each shared head."""
    if group == 1:
        return t
    return t.view(t.shape[0], heads, group, *t.shape[2:]).sum(2)


def _flash_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """PyTorch's CPU attention op (what `F.scaled_dot_product_attention` and transformers' sdpa reach on the
    CPU, any mask: sliding windows, padding) in routed ATen ops: the matmuls, masks, log-sum-exp and softmax
    in fp32. On a GPU, the model's attention is `ops.scaled_dot_product_attention` (the kernels above)."""
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: the routed attention has no attention dropout; use 0")
    p, lse, _, _, group = _math_probabilities(query, key, attn_mask, is_causal, scale)
    vf = value.float().repeat_interleave(group, 1) if group > 1 else value.float()
    return torch.matmul(p, vf).to(query.dtype), lse


def _flash_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                            scale=None):
    p, _, kf, scale, group = _math_probabilities(query, key, attn_mask, is_causal, scale)
    vf = value.float().repeat_interleave(group, 1) if group > 1 else value.float()
    do = grad_out.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, kf)
    dk = torch.matmul(ds.transpose(-1, -2), query.float())
    heads = key.shape[1]
    return (dq.to(query.dtype), _grouped(dk, group, heads).to(key.dtype), _grouped(dv, group, heads).to(value.dtype))


ATEN = {
    "_scaled_dot_product_flash_attention_for_cpu": _flash_for_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _flash_for_cpu_backward,
}
