"""`model.impl=transformers`: a Hugging Face directory's causal LM run by transformers' own modeling code, behind
the interface our recipes call (`TransformersModel`), for any architecture transformers can build.

The model is built from the directory's config.json (`AutoConfig`, `AutoModelForCausalLM.from_config`) in fp32 with
SDPA attention (eager where the model has no SDPA), its parameters on the meta device and its buffers (rotary
tables) computed on the CPU and kept aside, so that a strategy places it like our decoder and each rank then reads
its own slices of the safetensors (`load_weights`). Parameter names are transformers' own under `causal_lm.`, so
checkpoints, LoRA targets (by module name, as PEFT matches them) and exports keep transformers' names.

Packed rows pass position ids that restart with each document; transformers then keeps attention within each
document (its packed-sequence masks). Incremental decoding keeps a transformers `DynamicCache` inside our
`KVCache` (its `hf`, from which `KVCache.keep` drops the ended rows), fed the cache's positions and padding. A model
with tied embeddings keeps one parameter, the input embedding's: the output layer reads it at each forward (a
parameter shared by two modules would not survive `to_empty`).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from trainer.errors import ConfigError

PREFIX = "causal_lm."
# config attributes by which a model's logits are more than its output layer applied to the final hidden states.
_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "final_logit_softcapping")


@contextlib.contextmanager
def _parameters_on_meta():
    """Inside, modules are built on the CPU but every parameter is moved to the meta device as it is registered:
    no weight is allocated, and buffers (rotary tables) get their real values."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register


def causal_lm(path: str, attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' causal LM of directory `path`, in fp32, parameters on the meta device. ConfigError where
    transformers cannot build it."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError("model.impl", "transformers", "needs the transformers package: pip install transformers") \
            from None
    try:
        config = AutoConfig.from_pretrained(path)
        with _parameters_on_meta():
            try:
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                        attn_implementation=attn_implementation)
            except ValueError:  # this model has no SDPA attention
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError("model.path", path, f"transformers cannot build its causal LM: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _decoder_layers(model: nn.Module, n_layers: int) -> str:
    """The dotted name of the list of decoder layers in `model` (`model.layers`, `gpt_neox.layers`, ...)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers:
            return name
    raise ConfigError("model.impl", "transformers", f"{type(model).__name__} holds no list of its {n_layers} "
                      "decoder layers, which strategies shard one by one")


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(batch, seq) positions that restart at 0 with each document of `documents` (batch, seq ids)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


class TransformersModel(nn.Module):
    """A transformers causal LM as our `Transformer` is called: `forward(tokens, targets, documents, cache,
    loss_fn)`, `hidden_states`, `output_weight`, `tok_embeddings`, `layers`, `max_seq_len`, `init_buffers`."""

    # A function (hidden, weight, targets) -> loss that never materialises the logits, or None.
    fused_loss_fn = None

    def __init__(self, lm: nn.Module, path: str):
        super().__init__()
        self.causal_lm, self.path = lm, path
        config = lm.config
        self.n_layers = config.num_hidden_layers
        self.max_seq_len = int(getattr(config, "max_position_embeddings", None) or 2048)
        self.tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
        if self.tied:
            del lm.get_output_embeddings().weight
        self.plain_head = all(getattr(config, k, None) in (None, 1, 1.0) for k in _LOGIT_TRANSFORMS)
        self._layers = _decoder_layers(lm, self.n_layers)
        # transformers 5 renames `past_key_values` to `cache`, one model at a time.
        self._cache_key = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
        self._built_buffers = {name: b.detach().clone() for name, b in lm.named_buffers()}

    @property
    def layers(self) -> nn.ModuleList:
        return self.causal_lm.get_submodule(self._layers)

    @property
    def tok_embeddings(self) -> nn.Module:
        return self.causal_lm.get_input_embeddings()

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab, dim) matrix that turns hidden states into logits."""
        return self.tok_embeddings.weight if self.tied else self.causal_lm.get_output_embeddings().weight

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Give the buffers (after `to_empty`, on whatever device they are) the values they were built with."""
        for name, value in self._built_buffers.items():
            self.causal_lm.get_buffer(name).copy_(value)

    def _inputs(self, tokens: torch.Tensor, documents: torch.Tensor | None, cache) -> dict:
        inputs = {"input_ids": tokens, "use_cache": False}
        if cache is not None:
            if cache.hf is None:
                from transformers import DynamicCache

                cache.hf = DynamicCache(config=self.causal_lm.config)
            inputs.update({self._cache_key: cache.hf}, use_cache=True, position_ids=cache.positions,
                          attention_mask=cache.valid[:, : cache.length].long())
            if getattr(self.causal_lm.config, "output_router_logits", False):
                # The router's balancing loss is a training term; decoding's mask spans the cached tokens too,
                # which a mixture of experts' loss would pair with this call's router logits (and fail).
                inputs["output_router_logits"] = False
        elif documents is not None:
            inputs["position_ids"] = document_positions(documents)
        return inputs

    def hidden_states(self, tokens: torch.Tensor, documents: torch.Tensor | None = None,
                      cache=None) -> torch.Tensor:
        """The final normed hidden states, (batch, seq, dim), as `Transformer.hidden_states` gives them."""
        return self.causal_lm.base_model(**self._inputs(tokens, documents, cache)).last_hidden_state

    def _logits(self, tokens: torch.Tensor, documents: torch.Tensor | None, cache) -> torch.Tensor:
        head = self.causal_lm.get_output_embeddings()
        if self.tied:  # the output layer reads the embedding's parameter, as it is now (gathered under FSDP2)
            head.__dict__["weight"] = self.tok_embeddings.weight
        try:
            return self.causal_lm(**self._inputs(tokens, documents, cache)).logits
        finally:
            head.__dict__.pop("weight", None)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, cache=None, loss_fn=None) -> torch.Tensor:
        """The logits (transformers' own forward), or with `targets` the mean cross-entropy in fp32; with
        `loss_fn(hidden, output_weight, targets)` (or a fused loss) that loss from the final hidden states."""
        fused = loss_fn or (self.fused_loss_fn if targets is not None else None)
        if fused is not None:
            if not self.plain_head:
                raise ConfigError("model.path", self.path, f"{type(self.causal_lm).__name__} transforms its logits "
                                  f"({', '.join(k for k in _LOGIT_TRANSFORMS if hasattr(self.causal_lm.config, k))}), "
                                  "which a loss from hidden states skips (recipe=dpo's, grpo's, rloo's and kd's "
                                  "chunked log-probs, kernels=triton's fused loss): model.impl=native runs dpo, grpo "
                                  "and rloo on it")
            return fused(self.hidden_states(tokens, documents, cache), self.output_weight, targets)
        logits = self._logits(tokens, documents, cache)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


def build(path: str) -> TransformersModel:
    """The model of directory `path` through transformers, its weights not loaded (parameters on meta)."""
    return TransformersModel(causal_lm(path), path)


def hf_name(name: str) -> str:
    """transformers' name (in the directory's safetensors) of our parameter `name`."""
    return name.removeprefix(PREFIX)


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def checkpoint_names(lm: nn.Module, saved: list[str]) -> dict[str, str]:
    """transformers' parameter name -> the directory's tensor name, for the tensors transformers loads by a
    rename alone (transformers 5 renames some on load, e.g. GPT-NeoX's `embed_out` to `lm_head`); tensors it
    converts (experts merged into one tensor, ...) are left out."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(lm)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    meta = dict.fromkeys(lm.state_dict())
    names = {}
    for key in saved:
        ours, converted = rename_source_key(key, renamings, converters, lm.base_model_prefix, meta)
        if converted is None:
            names[ours] = key
    return names


def load_weights(model: nn.Module, path: str) -> None:
    """Fill `model`'s parameters (sharded or not, on any device) from the safetensors files in `path`, each rank
    reading only its own slices (as `trainer.models.hf.load_weights` does for our decoder), then its buffers.
    Where transformers converts tensors on load rather than renaming them, each rank loads the model through
    transformers on the CPU and keeps its slices (`_load_converted`)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from trainer.models.hf import WRAPPED

    inner = _inner(model)
    params = {hf_name(name.replace(WRAPPED, "")): param for name, param in inner.named_parameters()
              if ".lora_" not in name}
    reader = HuggingFaceStorageReader(path)
    saved = reader.read_metadata().state_dict_metadata
    names = checkpoint_names(inner.causal_lm, list(saved))
    if not all(name in names for name in params):
        _load_converted(params, path)
    else:
        for name, param in params.items():
            if tuple(saved[names[name]].size) != tuple(param.shape):
                raise ConfigError("model.path", path, f"its weights hold {tuple(saved[names[name]].size)} for "
                                  f"{names[name]}, the model its config.json describes needs {tuple(param.shape)}")
        with torch.no_grad():
            dcp.load({names[name]: param for name, param in params.items()}, storage_reader=reader)
    inner.init_buffers()


@torch.no_grad()
def _load_converted(params: dict[str, torch.Tensor], path: str) -> None:
    """Fill `params` (transformers' names) from the model transformers loads from `path`, whole on the CPU; each
    rank keeps the slice its DTensor placement says."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    for name, param in params.items():
        if name not in whole or tuple(whole[name].shape) != tuple(param.shape):
            raise ConfigError("model.path", path, f"transformers loads no {name} of shape {tuple(param.shape)} "
                              "from it")
        full = whole[name].to(param.device, param.dtype)
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
        else:
            param.copy_(full)


def from_hf(path: str) -> TransformersModel:
    """The pretrained model in directory `path` through transformers, in fp32 on the CPU."""
    from trainer.models.hf import on_cpu

    return on_cpu(build(path), path, load_weights)


def lora_targets(model: TransformersModel, names) -> list[nn.Linear]:
    """The linear layers LoRA adapts for PEFT's `target_modules` `names`: every module whose name ends with one of
    them, as PEFT matches them. ConfigError for a name that matches no module, or a module that is not linear."""
    found = []
    for target in names:
        matches = [(n, m) for n, m in model.causal_lm.named_modules() if n == target or n.endswith("." + target)]
        if not matches:
            raise ConfigError("peft.target_modules", list(names), f"{type(model.causal_lm).__name__} has no module "
                              f"named {target}; its linear layers are named "
                              f"{', '.join(sorted(_linear_names(model.causal_lm)))}")
        for name, module in matches:
            if type(module) is not nn.Linear:
                raise ConfigError("peft.target_modules", list(names), f"{name} is a {type(module).__name__}; "
                                  "LoRA adapts nn.Linear layers")
            found.append(module)
    return found


def _linear_names(model: nn.Module) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def save_pretrained(model: TransformersModel, out: str) -> None:
    """Write `model` (whole, on the CPU, LoRA adapters merged or absent) as transformers saves it: config.json and
    model.safetensors in the model's own layout and names."""
    lm = model.causal_lm
    if model.tied:  # one parameter again, as transformers ties it
        lm.get_output_embeddings().weight = lm.get_input_embeddings().weight
    lm.save_pretrained(out)


def apply_kernels(model: TransformersModel, chosen: list[str]) -> TransformersModel:
    """kernels=triton on transformers' modeling code, which our module rewrites do not reach: the loss fused with
    the output layer where `fused_linear_cross_entropy` is chosen (the ATen ops of its layers reach our kernels
    through the kernel switch's ATen routing, `trainer.models.kernels.Kernels.routing`, kernels.aten=true)."""
    import ops

    if "fused_linear_cross_entropy" in chosen:
        model.fused_loss_fn = ops.fused_linear_cross_entropy
    return model
