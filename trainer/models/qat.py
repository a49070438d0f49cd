"""Quantization-aware training with torchao: `prepare` swaps a model's linear layers for torchao's fake-quantised
ones (the forward sees int4-rounded weights and int8-rounded activations, the gradient passes straight through),
`quantize` turns a model's linear weights into torchao's int4 form (the conversion after QAT, or post-training
quantisation of any model: the same weights give the same outputs), and `save` / `load` write and read that
form (`quantized.pt` and `quantization.json` beside a Hugging Face directory's fp weights)."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

WEIGHTS, SETTINGS = "quantized.pt", "quantization.json"


def _scheme(scheme: str, group_size: int):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup

    if scheme != "int8_dynamic_act_int4_weight":
        raise ValueError(f"train.qat={scheme!r}: the scheme is int8_dynamic_act_int4_weight")
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))


def prepare(model: nn.Module, scheme: str, group_size: int) -> nn.Module:
    """Fake-quantise `model`'s linear layers in place (on the meta device too, before it is sharded)."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    quantize_(model, QATConfig(_scheme(scheme, group_size), step="prepare"))
    return model


def quantize(model: nn.Module, scheme: str, group_size: int) -> nn.Module:
    """Quantise `model`'s (plain, fp32) linear weights in place into torchao's int4 tensors."""
    from torchao.quantization import quantize_

    quantize_(model, _scheme(scheme, group_size))
    return model


def save(model: nn.Module, scheme: str, group_size: int, out: str) -> None:
    """Write the quantised `model`'s state to `out` (a directory)."""
    torch.save(model.state_dict(), os.path.join(out, WEIGHTS))
    with open(os.path.join(out, SETTINGS), "w") as f:
        json.dump({"quant_method": "torchao", "scheme": scheme, "group_size": group_size}, f, indent=2)


def load(path: str) -> nn.Module:
    """The quantised model of `path` (written by `python -m trainer.export --quantize`), on the CPU."""
    from trainer.models import hf

    with open(os.path.join(path, SETTINGS)) as f:
        settings = json.load(f)
    model = hf.from_hf(path)
    quantize(model, settings["scheme"], settings["group_size"])
    state = torch.load(os.path.join(path, WEIGHTS), weights_only=False)  # torchao's tensor subclasses
    model.load_state_dict(state, assign=True)
    return model
