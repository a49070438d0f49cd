"""Tensor parallelism over `tp` with DTensor, as TorchTitan plans it for Llama.

Attention q/k/v and MLP w1/w3 are split by output (column-wise: heads and hidden units), attention o and
MLP w2 by input (row-wise); between blocks the residual stream is split along the sequence (sequence
parallelism), so the norms run on a shard of the tokens. The output projection is column-wise; with
loss parallelism its logits stay split over the vocabulary and the loss is computed on the shards.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.parallel import blocks


def uses_loss_parallel(cfg, vocab_size: int, tp: int) -> bool:
    return tp > 1 and cfg.loss_parallel and vocab_size % tp == 0


def parallelize(model: nn.Module, tp_mesh, cfg) -> None:
    """Apply the tensor-parallel plan to `model` in place."""
    loss_parallel = uses_loss_parallel(cfg, model.tok_embeddings.num_embeddings, tp_mesh.size())
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def apply(model: nn.Module, mesh, cfg, device) -> nn.Module:
    parallelize(model, mesh["tp"], cfg)
    blocks.apply(model, cfg)
    model.to_empty(device=device)
    return model
