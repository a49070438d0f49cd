"""LoRA adapters on our `Transformer` (`peft=lora`), in place and before any strategy shards the model.

Each target `nn.Linear` becomes a `LoRALinear`: the same module (its `weight` and `bias` keep their names,
so pretrained weights, checkpoints and strategies see what they always see) plus `lora_A` (rank x in) and
`lora_B` (out x rank). Everything else is frozen. As in PEFT, A starts Kaiming-uniform and B at zero, so
training starts from the pretrained model exactly; A is drawn whole per name and seed, so every strategy
and world size starts from the same adapters. Names map to PEFT's (`base_model.model.<hf name>.lora_A.weight`).

Each family names its targets as its checkpoint does (`Family.lora_targets`). A fused checkpoint tensor (Phi-3's
`qkv_proj`, `gate_up_proj`) is several of our layers: each gets its own adapter of rank r, and the export joins
them into the one adapter PEFT puts on the fused layer, of rank r x pieces: A stacked, B block-diagonal (its
`rank_pattern` and `alpha_pattern` keep the scaling alpha / r), which computes exactly what ours do.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.config.families import Family
from trainer.models import hf_transformers
from trainer.models.hf import WRAPPED, _fused_names, _inner, family_of, hf_name


class LoRALinear(nn.Linear):
    """A linear layer plus its low-rank update: y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T."""

    adapter_on = True  # off: the base layer alone (see `without_adapters`)

    def add_adapter(self, rank: int, alpha: float, dropout: float) -> None:
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=self.weight.device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_on:
            return out
        # The scaling on the rank-wide product, not the output (the same numbers where alpha / rank is a power of
        # two, as at the defaults); no dropout pass where there is none. Unsharded, B's product adds onto the
        # base's output inside the matrix product (addmm), with no output-sized temporary.
        low = self.lora_A(x if isinstance(self.lora_dropout, nn.Identity) else self.lora_dropout(x)) * self.scaling
        if isinstance(out, DTensor):
            return out + self.lora_B(low)
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), low.reshape(-1, low.shape[-1]), self.lora_B.weight.t())
        return flat.view(out.shape)


def apply(model: nn.Module, cfg) -> nn.Module:
    """Add adapters to `cfg.target_modules` of every block and freeze everything else (`cfg`: the peft section)."""
    if cfg.name != "lora":
        return model
    if isinstance(model, hf_transformers.TransformersModel):  # by module name, as PEFT matches them
        linears = hf_transformers.lora_targets(model, cfg.target_modules)
    else:
        targets = family_of(model).lora_targets
        linears = [block.get_submodule(name) for block in model.layers.values() for target in cfg.target_modules
                   for name in targets[target]]
    for linear in linears:
        linear.__class__ = LoRALinear
        linear.add_adapter(cfg.rank, cfg.alpha, cfg.dropout)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    return model


def without_adapters(model: nn.Module):
    """`model` (wrapped or sharded as it trains) with its adapters off, as a function of its inputs: the
    pretrained model that LoRA starts from (B = 0), so recipe=dpo's reference costs no second copy."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]

    def forward(*args, **kwargs):
        for layer in layers:
            layer.adapter_on = False
        try:
            return model(*args, **kwargs)
        finally:
            for layer in layers:
                layer.adapter_on = True

    return forward


def trainable_parameters(model: nn.Module) -> str:
    """PEFT's `print_trainable_parameters` line for `model`: the trainable parameters, all of them (the adapters
    included), and the share; a sharded parameter counts whole (a DTensor's numel is its global one)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}"


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def init_adapters(model: nn.Module, shapes: dict, seed: int) -> None:
    """Give every adapter its starting value (A: Kaiming-uniform from the seed and its name; B: zero)."""
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    with torch.no_grad():
        for name, param in inner.named_parameters():
            clean = name.replace(WRAPPED, "")
            if not is_adapter(clean):
                continue
            shape, dtype = shapes[clean]
            full = torch.zeros(shape, dtype=dtype)
            if ".lora_A." in clean:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(clean.encode()))
                bound = 1 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)), nn.Linear's and PEFT's default
                full.uniform_(-bound, bound, generator=gen)
            full = full.to(param.device)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)


def peft_name(name: str, family: Family | None = None) -> str:
    """PEFT's key for our adapter parameter `name` (`layers.0.attention.wq.lora_A.weight`)."""
    module, leaf = name.split(".lora_", 1)
    if module.startswith(hf_transformers.PREFIX):  # model.impl=transformers: transformers' names already
        return f"base_model.model.{hf_transformers.hf_name(module)}.lora_{leaf}"
    return f"base_model.model.{hf_name(module + '.weight', family).removesuffix('.weight')}.lora_{leaf}"


def peft_state(adapters: dict[str, torch.Tensor], family: Family | None) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors' tensors for our whole adapter parameters `adapters`, the pieces of a fused
    layer joined (A stacked by rows, B block-diagonal); `family` None: model.impl=transformers (its own names)."""
    out, fused = {}, {}
    for name, p in adapters.items():
        module, leaf = name.split(".lora_", 1)
        if family is not None and _inner(module + ".weight") in _fused_names(family):
            fused.setdefault((peft_name(name, family), leaf[0]), {})[_inner(module + ".weight")] = p
        else:
            out[peft_name(name, family)] = p.contiguous()
    for (key, which), parts in fused.items():
        order = next(o for o in family.fused.values() if set(parts) <= set(o))
        pieces = [parts[piece] for piece in order]
        out[key] = (torch.cat(pieces) if which == "A" else torch.block_diag(*pieces)).contiguous()
    return out


def adapter_config(cfg, base: str, family: Family | None = None) -> dict:
    """adapter_config.json as PEFT writes it for these adapters on the model in directory `base`."""
    targets = family.lora_targets if family else {}
    joined = {t: len(targets[t]) for t in cfg.target_modules if len(targets.get(t, ())) > 1}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(cfg.target_modules),
        "rank_pattern": {t: cfg.rank * n for t, n in joined.items()},
        "alpha_pattern": {t: cfg.alpha * n for t, n in joined.items()},
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (W += scaling * B A) and turn the layers back into nn.Linear."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.weight += module.scaling * module.lora_B.weight @ module.lora_A.weight
            del module.lora_A, module.lora_B, module.lora_dropout
            module.__class__ = nn.Linear
    return model
