"""The kernel switch of a rank, decided once from the run's `kernels` (and `optim`) sections: `Kernels.of`. It
holds the four things `kernels=torch|triton` changes, and nothing else on the ranks reads the section:
- the model's rewrites (`Kernels.apply`): `kernels=triton` points the model's RMSNorm, rotary embedding,
  attention, SwiGLU gate and loss at the Triton ops of `ops/` (the loss fused with the output projection, so the
  logits are never materialised); `kernels.include` / `kernels.exclude` choose among those five
  (`trainer.config.TRITON_OPS`) as among the ATen ops;
- the ATen routing (`Kernels.routing`): the ATen ops `ops.use_kernels` routes to ours while the loop runs a
  training step or an eval batch (`kernels.aten`);
- the optimizer's implementation (`Kernels.optimizer`): ops' AdamW or torch.optim's (`optim.impl`);
- the recipes' token log-probabilities (`Kernels.token_logps`): their log-softmax the Triton cross-entropy where
  the loss is routed.

Attention takes packed rows as document ids (`attention`); one packed row (`data.packing=padding_free`) runs it
causal over each document. Under `model.impl=transformers`, whose modeling code these rewrites do not reach,
only the loss is fused (`hf_transformers.apply_kernels`); its layers reach our kernels through the ATen routing.

The families' pieces: `(1 + w)` norms are `ops.rms_norm` with the weight plus one; GeLU-tanh gates (Gemma) go to
`ops.gelu_and_mul(approximate="tanh")` with `silu_and_mul`; an attention `scale` (Gemma's query_pre_attn_scalar,
Granite's multiplier) is the kernel's. Sliding-window layers and soft-capped attention keep PyTorch's attention
(the kernel has neither a window nor a cap), and a model whose final logits are soft-capped keeps PyTorch's loss.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ops.aten_routes import NAMES
from trainer.config import TRITON_OPS
from trainer.models import chunked, hf_transformers
from trainer.models.llama import Attention, FeedForward, RMSNorm, Transformer


def attention(query, key, value, attn_mask=None, is_causal=False, enable_gqa=False, scale=None):
    """`ops.scaled_dot_product_attention` as the model calls it. Packed rows come as the model's boolean
    (batch, 1, seq, seq) mask, causal within each document (`Transformer.hidden_states`): query i then
    sees keys start..i of its document, so i + 1 - (its visible keys) is where that document starts, a
    number that is the same for every token of the document and differs between documents: the
    document ids the kernel takes, with causal attention. A boolean mask of another shape (generation's
    padding mask over the cache, one or a few queries) is attention written in routed ATen ops; any other
    mask goes to the op, which says what it takes."""
    import ops

    if (attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.dim() == 4
            and attn_mask.shape[1] == 1 and attn_mask.shape[2] == attn_mask.shape[3] == query.shape[2]):
        seq = attn_mask.shape[-1]
        starts = torch.arange(1, seq + 1, device=attn_mask.device) - attn_mask[:, 0].sum(-1)
        return ops.scaled_dot_product_attention(query, key, value, attn_mask=starts, is_causal=True,
                                                enable_gqa=enable_gqa, scale=scale)
    if attn_mask is not None and attn_mask.dtype == torch.bool and not is_causal:
        return _masked_attention(query, key, value, attn_mask, scale)
    return ops.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                            enable_gqa=enable_gqa, scale=scale)


def _masked_attention(query, key, value, mask, scale):
    """Attention under a boolean mask (generation's padding mask over the cache: few queries) in ATen ops
    that kernels=triton routes (matmul, masked_fill, softmax): K/V heads repeated as views, no extra kernel."""
    batch, heads, keys, dim = key.shape
    group = query.shape[1] // heads
    if group > 1:
        key = key[:, :, None].expand(batch, heads, group, keys, dim).reshape(batch, heads * group, keys, dim)
        value = value[:, :, None].expand(batch, heads, group, keys, value.shape[-1]).reshape(
            batch, heads * group, keys, value.shape[-1])
    scores = torch.matmul(query, key.transpose(-1, -2)) * (dim**-0.5 if scale is None else scale)
    weights = torch.softmax(scores.float().masked_fill(mask.logical_not(), float("-inf")), -1)
    return torch.matmul(weights.to(value.dtype), value)


def gelu_tanh_and_mul(x, y):
    import ops

    return ops.gelu_and_mul(x, y, approximate="tanh")


@dataclass(frozen=True)
class Kernels:
    """What the kernels section decides on a rank (`Kernels.of`, once per run; the worker hands it to the model's
    assembly, the loop and the recipes): `model_ops`, the model's functions pointed at ops/; `aten`,
    `ops.use_kernels`' (include, exclude) or None when no ATen op is routed; `optimizer`, torch or triton."""

    model_ops: tuple[str, ...] = ()
    aten: tuple[list[str] | None, list[str]] | None = None
    optimizer: str = "torch"

    @classmethod
    def of(cls, kernels, optim=None) -> Kernels:
        """The switch of the kernels section `kernels` (and the optim section `optim`, where an optimizer is made)."""
        return cls(_model_ops(kernels), _aten_ops(kernels),
                   _optimizer(optim, kernels.name) if optim is not None else "torch")

    def apply(self, model: nn.Module) -> nn.Module:
        """Point `model`'s functions at the chosen Triton ops, in place (on the meta model, before any strategy)."""
        if not self.model_ops:
            return model
        if isinstance(model, hf_transformers.TransformersModel):
            return hf_transformers.apply_kernels(model, list(self.model_ops))
        _rewrite(model, self.model_ops)
        return model

    def routing(self) -> contextlib.AbstractContextManager:
        """The ATen ops routed to ops/ (`ops.use_kernels`) inside the block, or nothing routed: what the training
        step and eval run under (on model.impl=transformers the one way our kernels reach its modeling code)."""
        if self.aten is None:
            return contextlib.nullcontext()
        import ops

        return ops.use_kernels(*self.aten)

    @property
    def token_logps(self) -> Callable:
        """The model's `loss_fn` that gives (batch, seq) log p(target) (`chunked.token_logps`), its chunks'
        log-softmax the Triton cross-entropy where kernels=triton routes the loss."""
        return self._with_ce(chunked.token_logps)

    @property
    def token_logps_entropy(self) -> Callable:
        """`chunked.token_logps_entropy` (recipe=ppo's policy: log-probabilities and entropy at a temperature), its
        chunks' log-softmax chosen as `token_logps`'."""
        return self._with_ce(chunked.token_logps_entropy)

    def _with_ce(self, fn: Callable) -> Callable:
        """`fn` with the Triton cross-entropy (`ce=`) where kernels=triton routes the loss, else as it is."""
        if "fused_linear_cross_entropy" in self.model_ops:
            import ops

            return functools.partial(fn, ce=ops.cross_entropy)
        return fn


def _model_ops(cfg) -> tuple[str, ...]:
    """The model's functions (TRITON_OPS) that the kernels section `cfg` points at ops/: none under
    kernels=torch, else `include` (null: all) less `exclude`."""
    if cfg.name != "triton":
        return ()
    return tuple(op for op in (cfg.include or TRITON_OPS) if op in TRITON_OPS and op not in (cfg.exclude or []))


def _aten_ops(cfg) -> tuple[list[str] | None, list[str]] | None:
    """`ops.use_kernels`' (include, exclude) for the kernels section `cfg` (include None: every ATen op), or
    None when no ATen op is routed (kernels=torch, kernels.aten=false, or an include of model ops only)."""
    if cfg.name != "triton" or not getattr(cfg, "aten", True):
        return None
    include = [op for op in cfg.include if op in NAMES] if cfg.include else None
    if include == []:
        return None
    return include, [op for op in cfg.exclude or [] if op in NAMES]


def _optimizer(optim, kernels: str) -> str:
    """The optim section's `impl`, or its default under `kernels=<kernels>`: triton for AdamW under
    kernels=triton, else torch."""
    if optim.impl is not None:
        return optim.impl
    return "triton" if kernels == "triton" and optim.name == "adamw" else "torch"


def _rewrite(model: nn.Module, chosen: tuple[str, ...]) -> None:
    """Our decoder's functions pointed at the ops of `chosen`."""
    import ops

    for module in model.modules():
        if isinstance(module, RMSNorm) and "rms_norm" in chosen:
            module.norm_fn = ops.rms_norm
        elif isinstance(module, Attention):
            if "rotary_embedding" in chosen:
                module.rope_fn = ops.rotary_embedding
            if "scaled_dot_product_attention" in chosen and not module.sliding and module.softcap is None:
                module.attention_fn = attention
        elif isinstance(module, FeedForward) and "silu_and_mul" in chosen:
            module.gate_fn = ops.silu_and_mul if module.activation == "silu" else gelu_tanh_and_mul
        elif (isinstance(module, Transformer) and "fused_linear_cross_entropy" in chosen
              and module.final_softcap is None):
            module.fused_loss_fn = ops.fused_linear_cross_entropy
