"""A fused, multi-tensor AdamW step: for every parameter of a group, its decay, both moment updates and the
update itself in one kernel launch that reads each parameter, its gradient and its two moments once and
writes three of them back, instead of the dozen elementwise passes of PyTorch's single-tensor AdamW.

`adamw(...)` steps a list of parameters; `AdamW` is the `torch.optim.Optimizer` around it, with
torch.optim.AdamW's arguments, param-group keys and state (`step`, `exp_avg`, `exp_avg_sq`), so that a
state dict (and a DCP checkpoint through `get_optimizer_state_dict`) saved by either loads into the other.
The arithmetic is torch's, computed in fp32: p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps) (with g negated under `maximize`).

As torch's `foreach` implementation groups its tensors by device and dtype, `adamw` groups them by device,
dtypes and step count and launches one kernel per group: a table of the group's tensor addresses, and one
program per block of any of its tensors (`_adamw`). DTensor parameters (FSDP2) step their local shards;
their moments are DTensors like torch's, so a sharded checkpoint holds them as torch's would.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor

from ops.multi_tensor import TL, addresses, blocks
from ops.settings import POINTWISE_BLOCK, warps


@triton.jit
def _adamw(p_table, g_table, m_table, v_table, sizes, block_tensor, block_start, lr, beta1, beta2, eps, decay,
           step_size, bc2_sqrt, sign, P: tl.constexpr, G: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    t = tl.load(block_tensor + block)
    offs = tl.load(block_start + block) + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < tl.load(sizes + t)
    p_ptr = tl.load(p_table + t).to(tl.pointer_type(P))
    g_ptr = tl.load(g_table + t).to(tl.pointer_type(G))
    m_ptr = tl.load(m_table + t).to(tl.pointer_type(S))
    v_ptr = tl.load(v_table + t).to(tl.pointer_type(S))
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * sign
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * (1.0 - lr * decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_ptr + offs, p.to(P), mask=mask)
    tl.store(m_ptr + offs, m.to(S), mask=mask)
    tl.store(v_ptr + offs, v.to(S), mask=mask)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view); any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _launch(params, grads, avgs, sqs, step: int, lr, beta1, beta2, eps, weight_decay, sign) -> None:
    """One launch over tensors that share a device, dtypes and step: a program per block of any of them."""
    device = params[0].device
    sizes, owner, start, n = blocks([p.numel() for p in params], device)
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = math.sqrt(1 - beta2**step)
    _adamw[(n,)](*(addresses(ts, device) for ts in (params, grads, avgs, sqs)), sizes, owner, start,
                 lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt, sign, P=TL[params[0].dtype],
                 G=TL[grads[0].dtype], S=TL[avgs[0].dtype], BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))


def adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
          exp_avg_sqs: list[torch.Tensor], steps: list[int], lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, maximize: bool = False) -> None:
    """One AdamW step over a list of parameters, in place; `steps` are each parameter's step count after
    this step (1 on the first). DTensors step their local shards; every (local) tensor must be contiguous,
    of its parameter's shape, and fp32, bf16 or fp16."""
    groups: dict[tuple, list[tuple]] = {}
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        p, g, m, v = _local(p), _local(g), _local(m), _local(v)
        for name, t in (("parameter", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
            if t.shape != p.shape or not t.is_contiguous() or t.dtype not in TL or t.device != p.device:
                raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be contiguous, fp32, bf16 or fp16, and "
                                 f"of its parameter's shape {tuple(p.shape)} and device")
        if m.dtype != v.dtype:
            raise ValueError(f"exp_avg {m.dtype} and exp_avg_sq {v.dtype} must share a dtype")
        if p.numel():
            groups.setdefault((p.device, p.dtype, g.dtype, m.dtype, int(step)), []).append((p, g, m, v))
    for (_, _, _, _, step), tensors in groups.items():
        _launch(*map(list, zip(*tensors, strict=True)), step, lr, beta1, beta2, eps, weight_decay,
                -1.0 if maximize else 1.0)


# torch.optim.AdamW's param-group keys and the values this implementation takes for those it does not vary:
# a state dict carries every key, so each optimizer finds its own in the other's (DCP loads key by key).
FIXED = {"amsgrad": False, "capturable": False, "differentiable": False, "fused": None,
         "decoupled_weight_decay": True}


def _scalar_step(step) -> torch.Tensor:
    """A step count as torch's AdamW keeps it (a CPU scalar of the default dtype)."""
    return torch.tensor(float(step), dtype=torch.get_default_dtype())


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (decoupled weight decay; `maximize`; no amsgrad, capturable, differentiable or fused
    variants), with one kernel launch per group of parameters that share a device, dtypes and step."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay}: each must be >= 0")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas={betas}: each must be in [0, 1)")
        given = {"amsgrad": amsgrad, "capturable": capturable, "differentiable": differentiable, "fused": fused}
        other = {k: v for k, v in given.items() if v and v != FIXED[k]}
        if other:
            raise ValueError(f"{', '.join(f'{k}={v}' for k, v in other.items())}: ops.AdamW is the plain "
                             "(foreach) AdamW; use torch.optim.AdamW for those variants")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "maximize": maximize, "foreach": foreach, **FIXED})
        self.register_state_dict_post_hook(AdamW._torch_steps)
        self.register_load_state_dict_post_hook(AdamW._int_steps)

    @staticmethod
    def _torch_steps(optimizer, state_dict: dict) -> dict:
        """Step counts as torch's AdamW writes them (scalar tensors); the state itself keeps plain ints,
        which counting does without a kernel."""
        state_dict["state"] = {k: {**s, "step": _scalar_step(s["step"])} if "step" in s else s
                               for k, s in state_dict["state"].items()}
        return state_dict

    @staticmethod
    def _int_steps(optimizer) -> None:
        for state in optimizer.state.values():
            if "step" in state:
                state["step"] = int(state["step"])

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
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] = int(state["step"]) + 1
                params.append(p)
                grads.append(p.grad if _local(p.grad).is_contiguous() else p.grad.contiguous())
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            beta1, beta2 = (float(b) for b in group["betas"])
            adamw(params, grads, avgs, sqs, steps, float(group["lr"]), beta1, beta2, float(group["eps"]),
                  float(group["weight_decay"]), bool(group["maximize"]))
        return loss
