"""The `model` section: the transformer's sizes (`model=debug|llama3_8b|hf|...`) and the options of the
pretrained families (`trainer.config.families`), which `model=hf` reads from config.json; their defaults are
Llama's, so the presets are Llama-style decoders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from omegaconf import MISSING

from trainer.config.checks import one_of, read_by, require
from trainer.config.families import BY_NAME

# The byte-level tokenizer's vocabulary (`trainer.data.tokenizer`): the 256 bytes, then BOS, EOS and PAD.
BYTE_VOCAB_SIZE = 259
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    # Each must be > 0 (`trainer.config.validate` checks it before `check()`).
    POSITIVE: ClassVar[tuple[str, ...]] = (
        "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "rope_theta", "norm_eps",
        "init_std"
    )
    name: str = MISSING  # the option chosen: a preset (debug, small, 1b, 8b) or hf (a Hugging Face directory)
    # model=hf: a Hugging Face model directory, or its URL (hf://<org>/<name>[@<revision>], s3://<bucket>/<prefix>,
    # gs://...: fetched once into the storage cache, docs/storage.md); the keys below are read from its config.json.
    path: str | None = read_by("hf", default=None)
    # model=hf: the code that runs it, native (trainjob's decoder) or transformers (the directory's own modeling
    # code); unset, config.json chooses (trainer.config.hf_impl).
    impl: str | None = read_by("hf", default=None)
    dim: int = MISSING  # the hidden size (the width of the residual stream)
    n_layers: int = MISSING  # transformer blocks
    n_heads: int = MISSING  # attention heads (query heads)
    n_kv_heads: int = MISSING  # key/value heads (grouped-query attention: n_heads is a multiple)
    ffn_dim: int = MISSING  # the MLP's hidden size
    vocab_size: int = BYTE_VOCAB_SIZE  # token ids the embedding takes (259: the byte-level tokenizer's)
    max_seq_len: int = 2048  # the longest sequence the rotary embedding is built for
    rope_theta: float = 10000.0  # the base of the rotary position embedding
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tie_embeddings: bool = False  # the output layer shares the embedding's weight
    init_std: float = 0.02  # the standard deviation of the weights' initialisation (from scratch)
    # The family's options (trainer/config/families.py says which family sets which).
    family: str = "llama"  # the checkpoint layout: names, fused tensors
    head_dim: int | None = None  # None: dim / n_heads
    attention_bias: str = "none"  # none | qkv | all (q, k, v and o)
    mlp_bias: bool = False  # biases on the MLP's projections
    qk_norm: str = "none"  # none | head (each head's q and k) | full (the whole q and k projections)
    norm_placement: str = "pre"  # pre | sandwich (before and after attention and MLP) | post (after only)
    norm_offset: float = 0.0  # 1.0: norms scale by (1 + weight)
    activation: str = "silu"  # silu | gelu_tanh: the MLP's gate
    embedding_multiplier: float = 1.0  # the embedding's output is scaled by it (Granite)
    residual_multiplier: float = 1.0  # each block's output is scaled by it before the residual add (Granite)
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim)
    logits_scaling: float = 1.0  # the logits are divided by it
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # the window of layer_types' sliding_attention layers
    layer_types: list[str] | None = None  # per layer: full_attention | sliding_attention (None: all full)
    rope_local_theta: float | None = None  # the RoPE base of sliding layers (Gemma 3); None: rope_theta
    nope_layers: list[int] = field(default_factory=list)  # layers without RoPE (SmolLM3)
    n_experts: int = 0  # > 0: a mixture of experts MLP
    n_experts_per_token: int = 0  # experts each token is routed to (top-k)
    moe_ffn_dim: int | None = None  # each expert's hidden size (None: ffn_dim)
    dense_layers: list[int] = field(default_factory=list)  # layers with the dense MLP in an MoE model
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    router_aux_loss_coef: float = 0.0  # the weight of the router's load-balancing loss (with output_router_logits)
    output_router_logits: bool = False  # add router_aux_loss_coef x the load-balancing loss to the loss

    def check(self) -> None:
        require(self.impl in (None, "native", "transformers"), "model.impl", self.impl,
                "must be native or transformers (or unset: chosen from model=hf's config.json)")
        require(self.impl != "transformers" or self.name == "hf", "model.impl", self.impl,
                f"runs a Hugging Face directory through transformers: use model=hf model.path=<directory> "
                f"(model={self.name} is trainjob's own decoder)")
        if self.impl == "transformers":
            return  # the rules below are our decoder's
        if self.head_dim is None:
            require(self.dim % self.n_heads == 0, "model.dim", self.dim,
                    f"must be divisible by model.n_heads={self.n_heads} (or give model.head_dim)")
        head_dim = self.head_dim or self.dim // self.n_heads
        require(head_dim > 0 and head_dim % 2 == 0, "model.head_dim" if self.head_dim else "model.dim",
                self.head_dim or self.dim, f"the head size must be even for rotary embeddings (is {head_dim})")
        require(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
                f"must divide model.n_heads={self.n_heads}")
        self._check_options()

    def _check_options(self) -> None:
        one_of("model.family", self.family, tuple(BY_NAME))
        one_of("model.attention_bias", self.attention_bias, ("none", "qkv", "all"))
        one_of("model.qk_norm", self.qk_norm, ("none", "head", "full"))
        one_of("model.norm_placement", self.norm_placement, ("pre", "sandwich", "post"))
        one_of("model.activation", self.activation, ("silu", "gelu_tanh"))
        for key in ("attention_scale", "attn_softcap", "final_softcap", "sliding_window", "rope_local_theta"):
            value = getattr(self, key)
            require(value is None or value > 0, f"model.{key}", value, "must be > 0 (or null)")
        if self.layer_types is not None:
            require(len(self.layer_types) == self.n_layers and all(t in LAYER_TYPES for t in self.layer_types),
                    "model.layer_types", list(self.layer_types),
                    f"must give one of {', '.join(LAYER_TYPES)} for each of the model.n_layers={self.n_layers}")
            require("sliding_attention" not in self.layer_types or self.sliding_window is not None,
                    "model.sliding_window", self.sliding_window, "must be set where layer_types has sliding layers")
        for key in ("nope_layers", "dense_layers"):
            bad = [i for i in getattr(self, key) if not 0 <= i < self.n_layers]
            require(not bad, f"model.{key}", list(getattr(self, key)), f"must be layer indices < {self.n_layers}")
        if self.n_experts:
            require(0 < self.n_experts_per_token <= self.n_experts, "model.n_experts_per_token",
                    self.n_experts_per_token, f"must be 1 ... model.n_experts={self.n_experts}")
