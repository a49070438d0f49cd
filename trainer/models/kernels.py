"""The kernel backend: `kernels=torch` keeps PyTorch's eager kernels; `kernels=triton` points the model's
RMSNorm, rotary embedding, attention, SwiGLU gate and loss at the Triton ops of `ops/` (the loss fused
with the output projection, so the logits are never materialised). `kernels.include` / `kernels.exclude`
choose among those five (`trainer.config.TRITON_OPS`).
"""

from __future__ import annotations

from torch import nn

from trainer.config import TRITON_OPS
from trainer.models.llama import Attention, FeedForward, RMSNorm, Transformer


def selected(cfg) -> list[str]:
    """The ops `kernels=triton` routes, after include/exclude."""
    if cfg.name != "triton":
        return []
    chosen = list(cfg.include) if cfg.include else list(TRITON_OPS)
    return [op for op in chosen if op not in (cfg.exclude or [])]


def apply(model: nn.Module, cfg) -> nn.Module:
    """Point `model`'s functions at the chosen Triton ops, in place (on the meta model, before any strategy)."""
    chosen = selected(cfg)
    if not chosen:
        return model
    import ops

    for module in model.modules():
        if isinstance(module, RMSNorm) and "rms_norm" in chosen:
            module.norm_fn = ops.rms_norm
        elif isinstance(module, Attention):
            if "rotary_embedding" in chosen:
                module.rope_fn = ops.rotary_embedding
            if "scaled_dot_product_attention" in chosen:
                module.attention_fn = ops.scaled_dot_product_attention
        elif isinstance(module, FeedForward) and "silu_and_mul" in chosen:
            module.gate_fn = ops.silu_and_mul
        elif isinstance(module, Transformer) and "fused_linear_cross_entropy" in chosen:
            module.fused_loss_fn = ops.fused_linear_cross_entropy
    return model
