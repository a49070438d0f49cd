"""Options every strategy applies per transformer block: activation checkpointing and torch.compile."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Selective checkpointing keeps what is expensive to recompute (matmuls and attention) and recomputes
# the cheap, memory-heavy rest (norms, activations, rotary products).
_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply(model: nn.Module, cfg) -> None:
    """Wrap each block of `model.layers` for activation checkpointing and compile it, as `cfg` asks."""
    for name, block in list(model.layers.named_children()):
        if cfg.activation_checkpointing == "full":
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        elif cfg.activation_checkpointing == "selective":
            block = checkpoint_wrapper(block, preserve_rng_state=False,
                                       context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))
        if cfg.compile:
            block.compile(fullgraph=False)
        model.layers.register_module(name, block)
