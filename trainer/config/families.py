"""The model families trainjob runs natively, one declarative record each: what a family is, in one place.

A `Family` says how its decoder block is built (where its norms sit, `(1 + w)` norms, q/k norms, the MLP's
activation, Gemma's sqrt(hidden) embedding scale) and how its checkpoint names our parameters (`block`: our
name inside a block -> the Hugging Face name under `model.layers.<i>.`; `fused`: one checkpoint tensor that
holds several of ours, stacked by rows, split on load and joined on export; `moe`: the router and experts'
prefix and names). Everything a family leaves open (head_dim, biases, multipliers, soft-caps, sliding windows,
layers without RoPE, experts) is read from each model's config.json (`trainer.config.hf`), so one record
covers every size of the family. The decoder is `trainer.models.llama.Transformer`; no torch here (the config
reads these records before anything is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_ATTENTION = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
}
_MLP = {"feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj", "feed_forward.w3": "mlp.up_proj"}
_QK_NORMS = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
# Norms before attention and the MLP (Llama and most families).
_PRE = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma 2 and 3: norms before and after attention and the MLP.
_SANDWICH = {
    "attention_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffn_norm": "post_feedforward_layernorm",
}
# OLMo 2: norms after attention and the MLP only.
_POST = {"post_attention_norm": "post_attention_layernorm", "post_ffn_norm": "post_feedforward_layernorm"}
TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str  # config.json's `architectures[0]`
    block: dict  # our name inside a block -> the checkpoint's, under model.layers.<i>.
    norm_placement: str = "pre"  # pre: before attention and MLP; sandwich: before and after; post: after only
    norm_offset: float = 0.0  # 1.0: the norm multiplies by (1 + weight) (Gemma)
    qk_norm: str = "none"  # head: RMSNorm over each head's q and k; full: over the whole q and k projections
    embedding_scale: bool = False  # embeddings times sqrt(hidden_size), in the model's dtype (Gemma)
    qkv_bias: bool = False  # q/k/v biases whatever config.json says (Qwen2)
    tie_default: bool = False  # tie_word_embeddings when config.json does not say
    fused: dict = field(default_factory=dict)  # checkpoint tensor -> our tensors it stacks by rows
    moe: tuple | None = None  # (checkpoint prefix of router and experts, {our expert linear: theirs})

    @property
    def lora_targets(self) -> dict[str, tuple[str, ...]]:
        """PEFT's target module name -> our linear layers in a block that it adapts."""
        targets = {theirs.rsplit(".", 1)[1]: (ours,) for ours, theirs in self.block.items()
                   if ours.startswith(("attention.w", "feed_forward.w"))}
        for theirs, ours in self.fused.items():
            targets[theirs.rsplit(".", 1)[1]] = ours
        return targets


def _family(name, architecture, placement="pre", **options) -> Family:
    norms = {"pre": _PRE, "sandwich": _SANDWICH, "post": _POST}[placement]
    block = {**_ATTENTION, **norms}
    if options.get("qk_norm", "none") != "none":
        block.update(_QK_NORMS)
    if not options.get("moe"):
        block.update(_MLP)
    for ours in options.get("fused", {}).values():
        for name_ in ours:
            block.pop(name_)
    return Family(name, architecture, block, placement, **options)


_QWEN3_EXPERTS = ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})
FAMILIES = {f.architecture: f for f in (
    _family("llama", "LlamaForCausalLM"),
    _family("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    _family("mistral", "MistralForCausalLM"),
    _family("qwen3", "Qwen3ForCausalLM", qk_norm="head"),
    _family("gemma2", "Gemma2ForCausalLM", "sandwich", norm_offset=1.0, embedding_scale=True, tie_default=True),
    _family("gemma3", "Gemma3ForCausalLM", "sandwich", norm_offset=1.0, embedding_scale=True, tie_default=True,
            qk_norm="head"),
    _family("phi3", "Phi3ForCausalLM", fused={
        "self_attn.qkv_proj": ("attention.wq", "attention.wk", "attention.wv"),
        "mlp.gate_up_proj": ("feed_forward.w1", "feed_forward.w3"),
    }),
    _family("smollm3", "SmolLM3ForCausalLM", tie_default=True),
    _family("olmo2", "Olmo2ForCausalLM", "post", qk_norm="full"),
    _family("granite", "GraniteForCausalLM"),
    _family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm="head", moe=_QWEN3_EXPERTS),
    _family("mixtral", "MixtralForCausalLM", moe=("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"})),
)}
BY_NAME = {f.name: f for f in FAMILIES.values()}


def hf_name(family: Family, name: str) -> str:
    """The checkpoint's name for our parameter `name` (such as `layers.0.attention.wq.weight`); a fused piece
    gives the fused tensor's name."""
    module, leaf = name.rsplit(".", 1)
    if not module.startswith("layers."):
        return f"{TOP[module]}.{leaf}"
    _, index, inner = module.split(".", 2)
    prefix = f"model.layers.{index}."
    if inner in family.block:
        return f"{prefix}{family.block[inner]}.{leaf}"
    for theirs, ours in family.fused.items():
        if inner in ours:
            return f"{prefix}{theirs}.{leaf}"
    if inner in _MLP:  # a dense layer among experts (Qwen3-MoE's mlp_only_layers, decoder_sparse_step)
        return f"{prefix}{_MLP[inner]}.{leaf}"
    if family.moe and inner.startswith("feed_forward."):
        moe_prefix, experts = family.moe
        if inner == "feed_forward.gate":
            return f"{prefix}{moe_prefix}.gate.{leaf}"
        _, _, expert, linear = inner.split(".")
        return f"{prefix}{moe_prefix}.experts.{expert}.{experts[linear]}.{leaf}"
    raise KeyError(f"{name} has no name in a {family.name} checkpoint")


def fused_rows(family: Family, inner: str, sizes: dict[str, int]) -> tuple[int, int] | None:
    """(first row, rows) of our tensor `inner` (a block-relative module name) inside its fused checkpoint
    tensor, given every piece's row count (`sizes`), or None when `inner` is stored on its own."""
    for ours in family.fused.values():
        if inner in ours:
            start = 0
            for piece in ours:
                if piece == inner:
                    return start, sizes[piece]
                start += sizes[piece]
    return None
