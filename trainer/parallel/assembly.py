"""`assemble`: the one way a model of a run is made on its ranks, for the policy, recipe=dpo and recipe=grpo's
frozen reference, and recipe=kd's teacher alike: built on the meta device, the kernels applied, LoRA adapters
and QAT fake quantisation added where asked, sharded by the strategy, then initialised (drawn from the run
seed, or read from a Hugging Face directory). A frozen model trains nothing: no gradient, eval mode."""

from __future__ import annotations

import torch
from torch import nn

from trainer.models import build, hf, hf_transformers, init_weights, lora, param_shapes, score
from trainer.models.kernels import Kernels
from trainer.parallel import ParallelDims, parallelize


def assemble(model_cfg, cfg, dims: ParallelDims, kernels: Kernels, *, peft: bool = True, qat: bool = True,
             frozen: bool = False, score_head: bool = False, value_head: bool = False) -> nn.Module:
    """The model `model_cfg` (a `ModelConfig`) describes, ready on this rank under the run `cfg`'s strategy, its
    functions pointed at the kernels of the run's switch `kernels` (`trainer.models.kernels.Kernels`).
    `peft`: add `cfg.peft`'s adapters; `qat`: fake-quantise as `cfg.train.qat` says; `frozen`: no gradients;
    `score_head`: a sequence-classification head instead of the LM head (`trainer.models.score`), read from the
    directory when it holds one, else drawn from the run seed; `value_head`: a value head beside the LM head
    (recipe.value_model=shared), trained under peft=lora too."""
    with torch.device("meta"):
        model = kernels.apply(build(model_cfg))
        if score_head:
            score.attach(model)
    if peft:
        model = lora.apply(model, cfg.peft)
    if value_head:
        with torch.device("meta"):
            score.attach_value_head(model)
    if qat and cfg.train.qat != "none":
        from trainer.models import qat as fake_quant

        fake_quant.prepare(model, cfg.train.qat, cfg.train.qat_group_size)
    shapes = param_shapes(model)
    model = parallelize(model, dims, cfg.strategy)
    if model_cfg.name == "hf":
        if model_cfg.impl == "transformers":
            hf_transformers.load_weights(model, model_cfg.path)
        else:
            fresh = hf.load_weights(model, model_cfg.path)
            if fresh:
                init_weights(model, shapes, cfg.train.seed, model_cfg.init_std, model_cfg.n_layers, only=fresh)
    else:
        init_weights(model, shapes, cfg.train.seed, model_cfg.init_std, model_cfg.n_layers)
    if peft and cfg.peft.name == "lora":
        lora.init_adapters(model, shapes, cfg.train.seed)
    if frozen:
        model.requires_grad_(False)
        model.eval()
    return model
