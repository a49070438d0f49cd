"""`parallelize(model, dims, cfg)`: one function applies, from the degrees, tensor parallelism, activation
checkpointing, torch.compile, context parallelism (`trainer.parallel.context`, the rows split over the cp ranks),
and then FSDP2/HSDP (over dp_shard x cp) or DDP, in TorchTitan's order (`models/llama3/infra/parallelize.py`).

Tensor parallelism (DTensor, as TorchTitan plans it for Llama): attention q/k/v and MLP w1/w3 are split by
output (column-wise: heads and hidden units), attention o and MLP w2 by input (row-wise); between blocks
the residual stream is split along the sequence (sequence parallelism), so the norms run on a shard of the
tokens. Each family's pieces (`_block_plan`): norms after attention and MLP, q/k norms, a mixture's router and
experts. The output projection is column-wise; with loss parallelism its logits stay split over the
vocabulary and the loss is computed on the shards; a head of one output (a score or value head) is whole on each
rank instead (`_WholeHead`). Tied embeddings: the embedding is split by vocabulary
rows, which is how a column-wise output layer splits its weight, so the tied projection gathers the sequence
and each rank computes its own vocabulary's logits from its rows, with no extra communication.

LoRA layers (`trainer.models.lora.LoRALinear`) split with their weight: in a column-wise layer `lora_A` is whole on
every rank (it reads the whole input) and `lora_B` is split by output like the weight; in a row-wise layer
`lora_A` is split by input like the weight and `lora_B` is whole, its output a partial sum that the layer's
one reduce-scatter adds up with the weight's. So an adapter costs no communication of its own.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainer.config import ConfigError, StrategyConfig, torch_dtype
from trainer.models.lora import LoRALinear
from trainer.models.moe import MoE
from trainer.parallel import expert_parallel
from trainer.parallel.context import ContextParallel
from trainer.parallel.dims import ParallelDims


def parallelize(model: nn.Module, dims: ParallelDims, cfg: StrategyConfig) -> nn.Module:
    """Take the meta-device `model` and return it ready to train on this rank's device over `dims.mesh`
    (storage allocated, weights not yet initialised: see `trainer.models.init_weights`). Under pipeline
    parallelism, a `trainer.parallel.pipeline.StagedModel` of this rank's stages, each parallelized as a whole
    model would be."""
    if dims.pp > 1:
        return _pipelined(model, dims, cfg)
    mesh = dims.mesh
    device = _device(mesh)
    model = _parallelize_part(model, dims, cfg, device)
    if dims.ddp:  # DDP wraps a model whose storage exists
        model = DistributedDataParallel(
            model,
            process_group=mesh["dp_replicate"].get_group(),
            bucket_cap_mb=cfg.bucket_cap_mb,
            device_ids=[device] if device.type == "cuda" else None,
        )
    return model


def _device(mesh) -> torch.device:
    return torch.device(mesh.device_type, torch.cuda.current_device() if mesh.device_type == "cuda" else None)


def _parallelize_part(model: nn.Module, dims: ParallelDims, cfg: StrategyConfig, device: torch.device) -> nn.Module:
    """TP, activation checkpointing, compile and FSDP2 on `model` (a whole model or a pipeline stage's part)."""
    mesh = dims.mesh
    if dims.tp > 1 and getattr(model, "causal_lm", None) is not None:  # model.impl=transformers
        apply_shipped_tp(model, mesh["tp"])
    elif dims.tp > 1:
        # A later pipeline stage has no embedding; under pp the loss is never parallel (see uses_loss_parallel).
        vocab = model.tok_embeddings.num_embeddings if model.tok_embeddings is not None else 0
        apply_tp(model, mesh["tp"], uses_loss_parallel(cfg, vocab, dims))
    if cfg.activation_checkpointing != "none":
        apply_ac(model, cfg.activation_checkpointing)
    if cfg.compile:
        for block in model.layers.children():
            block.compile(fullgraph=False)
    if dims.ep > 1:  # the experts split, and sharded on a mesh of their own, before their blocks are
        expert_parallel.apply(model, dims, mixed_precision(cfg, device.type))
    if dims.cp > 1:
        model.context_parallel = ContextParallel(mesh["cp"])
    if dims.fsdp:
        apply_fsdp(model, _fsdp_mesh(dims), cfg, device.type)
    model.to_empty(device=device)
    expert_parallel.mark(model)
    return model


def _fsdp_mesh(dims: ParallelDims):
    """The ranks FSDP2 shards over (and averages the gradients of): dp_shard, with the context-parallel ranks
    (TorchTitan's dp_shard_cp: they hold the same model and read the same rows), and dp_replicate as HSDP's
    outer dimension."""
    mesh = dims.mesh
    if dims.cp == 1:
        return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else shard


def _pipelined(model: nn.Module, dims: ParallelDims, cfg: StrategyConfig) -> nn.Module:
    # Imported here: torch.distributed.pipelining imports torch._dynamo, seconds of a rank's start (and of each
    # elastic restart) that a run without pipeline parallelism never needs.
    from trainer.parallel.pipeline import Pipeline, StagedModel, split, stage_ids, stage_layers

    pp_mesh, device = dims.mesh["pp"], _device(dims.mesh)
    stages = dims.pp * cfg.stages_per_rank()
    layers = stage_layers(len(model.layers), stages, list(cfg.pp_split_points))
    ids = stage_ids(pp_mesh.get_local_rank(), dims.pp, cfg.stages_per_rank())
    parts = []
    for i in ids:
        part = split(model, i, layers[i], stages)
        part.sequence_shards = dims.tp
        parts.append(_parallelize_part(part, dims, cfg, device))
    runner = Pipeline(parts, ids, stages, cfg.pp_microbatches or stages, cfg.pp_schedule, pp_mesh.get_group(),
                      device)
    return StagedModel(parts, runner)


def uses_loss_parallel(cfg: StrategyConfig, vocab_size: int, dims) -> bool:
    """Whether the loss is computed on vocabulary shards: under tp, unless turned off or the vocabulary does not
    divide; never under pp, whose last stage hands the schedule's loss whole logits."""
    return dims.tp > 1 and dims.pp == 1 and cfg.loss_parallel and vocab_size % dims.tp == 0


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    """Apply the tensor-parallel plan to `model` in place."""
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    logits = Shard(-1) if loss_parallel else Replicate()
    plan = {}
    if model.tok_embeddings is not None:  # not a later pipeline stage
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:  # not an earlier pipeline stage
        plan["norm"] = SequenceParallel()
    if getattr(model, "score_head", False):  # one output: not split (`_WholeHead`)
        plan["output"] = _WholeHead()
    elif model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=logits, use_local_output=not loss_parallel
        )
    elif model.tied_output is not None:
        plan["tied_output"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            output_layouts=Shard(-1),
            desired_output_layouts=logits,
            use_local_output=not loss_parallel,
        )
    if getattr(model, "value_head", None) is not None:
        plan["value_head"] = _WholeHead()
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block))
    # SequenceParallel makes new parameters that require grad: a frozen norm (peft=lora) would train.
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)


_COLWISE = ("attention.wq", "attention.wk", "attention.wv")
_ROWWISE = ("attention.wo",)
_MLP_COLWISE, _MLP_ROWWISE = ("w1", "w3"), ("w2",)


def _linear(block: nn.Module, name: str, rowwise: bool, output=None):
    """The TP style of linear layer `name` (LoRA's where it has adapters): column-wise, or row-wise with its
    output placed as `output` (default: split along the sequence)."""
    lora = isinstance(block.get_submodule(name), LoRALinear)
    if not rowwise:
        return (_LoRAColwise if lora else ColwiseParallel)()
    return (_LoRARowwise if lora else RowwiseParallel)(output_layouts=output or Shard(1))


def _block_plan(block: nn.Module) -> dict:
    """A block's plan: the norms on the sequence-split residual stream (after-norms hand back plain tensors, as
    the row-wise layers before them do), q/k/v and o split by heads, q/k norms per head on each rank's heads or,
    over a whole projection (OLMo 2), on the gathered projection; the MLP, or each expert of a mixture, split by
    hidden units, the router whole."""
    plan = {"attention": PrepareModuleInput(
        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))}
    for name, after in (("attention_norm", False), ("post_attention_norm", True), ("ffn_norm", False),
                        ("post_ffn_norm", True)):
        if hasattr(block, name):
            plan[name] = SequenceParallel(use_local_output=after)
    qk_norm = block.attention.qk_norm
    for name in ("attention.q_norm", "attention.k_norm") if qk_norm != "none" else ():
        plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True) if qk_norm == "head" else _GatheredNorm()
    for name in _COLWISE + _ROWWISE:
        plan[name] = _linear(block, name, name in _ROWWISE)
    if isinstance(block.feed_forward, MoE):
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        plan["feed_forward.gate"] = _Replicated()
        for expert in block.feed_forward.experts:
            for name in _MLP_COLWISE + _MLP_ROWWISE:
                full = f"feed_forward.experts.{expert}.{name}"
                plan[full] = _linear(block, full, name in _MLP_ROWWISE, Replicate())
    else:
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in _MLP_COLWISE + _MLP_ROWWISE:
            plan[f"feed_forward.{name}"] = _linear(block, f"feed_forward.{name}", name in _MLP_ROWWISE)
    return plan


class _Replicated(ParallelStyle):
    """A module whole on every rank (a mixture's router): its parameters replicated DTensors, its input and
    output plain tensors, the same on every rank."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            _distribute(mod, mesh, {n: Replicate() for n, _ in mod.named_parameters(recurse=False)}, None)

        return distribute_module(
            module, device_mesh, partition,
            input_fn=lambda mod, inputs, mesh: tuple(
                DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs),
            output_fn=lambda mod, out, mesh: out.to_local())


class _WholeHead(ParallelStyle):
    """A head of one output on the sequence-split final hidden states (a score head: a reward model's, recipe=ppo's
    value model's; recipe=ppo's value head): one output row does not split over ranks, so its weight is whole on
    every rank (a replicated DTensor, its gradient each rank's tokens' partial sum), each rank computes its own
    tokens' outputs, and they are gathered back along the sequence into a plain tensor, the same on every rank."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            _distribute(mod, mesh, {n: Replicate() for n, _ in mod.named_parameters(recurse=False)}, None)

        def split(mod, inputs, mesh):
            x = inputs[0]
            return (x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(1)], run_check=False),)

        return distribute_module(module, device_mesh, partition, input_fn=split,
                                 output_fn=lambda mod, out, mesh: out.redistribute(placements=[Replicate()]).to_local())


class _GatheredNorm(ParallelStyle):
    """A norm over a whole column-wise projection (OLMo 2's q/k norms): the rank's columns are gathered, normed
    with the replicated weight, and split again."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            _distribute(mod, mesh, {n: Replicate() for n, _ in mod.named_parameters(recurse=False)}, None)

        def gather(mod, inputs, mesh):
            x = inputs[0]
            return (DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False).redistribute(
                placements=[Replicate()]),)

        return distribute_module(
            module, device_mesh, partition, input_fn=gather,
            output_fn=lambda mod, out, mesh: out.redistribute(placements=[Shard(out.dim() - 1)]).to_local())


def _distribute(module: nn.Module, mesh, placements: dict[str, Placement], src_data_rank) -> None:
    """Replace each of `module`'s own parameters by a DTensor with its placement in `placements`."""
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class _LoRAColwise(ColwiseParallel):
    """ColwiseParallel for a LoRA layer: weight and bias split by output, `lora_A` whole, `lora_B` split by output."""

    _WEIGHT = {"": Shard(0), "lora_A": Replicate(), "lora_B": Shard(0)}

    def _partition_linear_fn(self, name, module, device_mesh):
        if name in self._WEIGHT:
            _distribute(module, device_mesh, {"weight": self._WEIGHT[name], "bias": Shard(0)}, self.src_data_rank)


class _LoRARowwise(RowwiseParallel):
    """RowwiseParallel for a LoRA layer: the weight and `lora_A` split by input, the bias and `lora_B` whole."""

    _WEIGHT = {"": Shard(1), "lora_A": Shard(1), "lora_B": Replicate()}

    def _partition_linear_fn(self, name, module, device_mesh):
        if name in self._WEIGHT:
            _distribute(module, device_mesh, {"weight": self._WEIGHT[name], "bias": Replicate()}, self.src_data_rank)


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


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_ac(model: nn.Module, mode: str) -> None:
    """Wrap each transformer block for activation checkpointing: `full` or `selective`."""
    for name, block in list(model.layers.named_children()):
        extra = {"context_fn": _selective_contexts} if mode == "selective" else {}
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, **extra))


def mixed_precision(cfg: StrategyConfig, device_type: str) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision from strategy.param_dtype and reduce_dtype."""
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(cfg.param_dtype, device_type), reduce_dtype=torch_dtype(cfg.reduce_dtype, device_type)
    )


def apply_fsdp(model: nn.Module, dp_mesh, cfg: StrategyConfig, device_type: str) -> None:
    """`fully_shard` each transformer block and the root over `dp_mesh` (2-D: HSDP), with mixed precision."""
    policy = mixed_precision(cfg, device_type)
    layers = list(model.layers.children())
    for i, block in enumerate(layers):
        # The last block's parameters are needed again first in backward: keeping them saves an all-gather.
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=policy,
            reshard_after_forward=cfg.reshard_after_forward and i < len(layers) - 1,
        )
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)


# The styles of transformers' `base_model_tp_plan` that `apply_shipped_tp` takes, as DTensor's parallel styles;
# between them activations stay whole (no sequence parallelism), as in transformers' own tensor parallelism.
_SHIPPED_STYLES = {
    "colwise": lambda lora: (_LoRAColwise if lora else ColwiseParallel)(),
    "rowwise": lambda lora: (_LoRARowwise if lora else RowwiseParallel)(),
    "embedding_rowwise": lambda lora: RowwiseParallel(input_layouts=Replicate()),
}


class _Replicated(ParallelStyle):
    """A module outside the plan (a norm, the output layer): its parameters whole on every rank as DTensors (so
    that clipping and the optimizer see one kind of tensor), its inputs and outputs plain tensors."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def inputs(_, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False) if isinstance(a, torch.Tensor)
                         else a for a in args)

        def outputs(_, out, mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        _distribute(module, mesh, {name: Replicate() for name, _ in module.named_parameters(recurse=False)}, None)
        module.register_forward_pre_hook(lambda m, args: inputs(m, args, mesh))
        module.register_forward_hook(lambda m, args, out: outputs(m, out, mesh))
        return module


def apply_shipped_tp(model: nn.Module, tp_mesh) -> None:
    """Tensor parallelism on a `model.impl=transformers` model from the plan its config class ships
    (`base_model_tp_plan`: module name patterns under the base model, each a style); the modules it leaves out
    keep their parameters whole (`_Replicated`)."""
    lm = model.causal_lm
    plan = dict(getattr(lm.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ConfigError("strategy", "tp", f"{type(lm).__name__} ships no tensor-parallel plan "
                          "(base_model_tp_plan): use strategy=ddp or fsdp2")
    if model.tied:
        raise ConfigError("strategy", "tp", f"{type(lm).__name__} ties its output layer to its embedding, which "
                          "its plan splits by rows: use strategy=ddp or fsdp2")
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    styles = {}
    for pattern, style in plan.items():
        if style not in _SHIPPED_STYLES:
            raise ConfigError("strategy", "tp", f"{type(lm).__name__}'s plan splits {pattern} as {style}; trainjob "
                              f"takes {', '.join(_SHIPPED_STYLES)}: use strategy=ddp or fsdp2")
        for name, module in lm.base_model.named_modules():
            if fnmatch.fnmatchcase(name, pattern):
                lora = isinstance(module, LoRALinear)
                styles[f"causal_lm.{lm.base_model_prefix}.{name}"] = _SHIPPED_STYLES[style](lora)
    parallelize_module(model, tp_mesh, styles)
    rest = {name: _Replicated() for name, module in model.named_modules()
            if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False))}
    parallelize_module(model, tp_mesh, rest)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)

