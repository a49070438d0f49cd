"""A fused AdamW step: each parameter's decay, both moment updates and the update itself in one kernel
that reads the parameter, its gradient and its two moments once and writes three of them back, instead of
the dozen elementwise passes of PyTorch's single-tensor AdamW.

`adamw(...)` steps a list of parameters; `AdamW` is the `torch.optim.Optimizer` around it, with
torch.optim.AdamW's arguments and state names (`step`, `exp_avg`, `exp_avg_sq`), so its state dict loads
either way. The arithmetic is torch's, computed in fp32: p *= 1 - lr*wd; m = b1*m + (1-b1)*g;
v = b2*v + (1-b2)*g^2; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ops.settings import POINTWISE_BLOCK, warps


@triton.jit(do_not_specialize=["n"])
def _adamw(p_ptr, g_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, decay, step_size, bc2_sqrt,
           BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * (1.0 - lr * decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
          exp_avg_sqs: list[torch.Tensor], steps: list[int], lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float) -> None:
    """One AdamW step over a list of parameters, in place; `steps` are each parameter's step count after
    this step (1 on the first). Every tensor must be contiguous."""
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        for name, t in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
            if t.shape != p.shape or not t.is_contiguous():
                raise ValueError(f"{name} {tuple(t.shape)} must be contiguous and of its parameter's shape "
                                 f"{tuple(p.shape)}")
        if not p.is_contiguous():
            raise ValueError(f"parameter {tuple(p.shape)} must be contiguous")
        n = p.numel()
        if not n:
            continue
        step_size = lr / (1 - beta1**step)
        bc2_sqrt = math.sqrt(1 - beta2**step)
        _adamw[(triton.cdiv(n, POINTWISE_BLOCK),)](p, g, m, v, n, lr, beta1, beta2, eps, weight_decay, step_size,
                                                    bc2_sqrt, BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's arithmetic (decoupled weight decay, no amsgrad), each parameter in one kernel."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay}: each must be >= 0")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas={betas}: each must be in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, avgs, sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("AdamW takes dense gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0  # a count, not a tensor: counting costs no kernel (torch loads either)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] = int(state["step"]) + 1
                params.append(p)
                grads.append(p.grad.contiguous())
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            beta1, beta2 = group["betas"]
            adamw(params, grads, avgs, sqs, steps, float(group["lr"]), beta1, beta2, group["eps"],
                  group["weight_decay"])
        return loss
