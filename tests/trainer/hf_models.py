"""Tiny pretrained-model directories for the fine-tuning tests, built with `transformers` (no download):
random Llama (with Llama 3.1's RoPE scaling) and Qwen2 (q/k/v biases, tied embeddings, sharded weights)."""

from __future__ import annotations

import json
import os

import torch

SHAPE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _perturbed(model):
    # transformers initialises biases to zero and norms to one; move every tensor so that each one counts.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def make_llama(root: str, tie: bool = False) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0, tie_word_embeddings=tie)
    path = os.path.join(root, "llama-tied" if tie else "llama")
    _perturbed(LlamaForCausalLM(config)).save_pretrained(path)
    return path


def make_llama_scorer(root: str) -> str:
    """A reward model of make_llama's shape, as recipe=reward exports one: a one-label
    LlamaForSequenceClassification padding with add_tokenizer's <|pad|> (id 2), with that tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, num_labels=1, pad_token_id=2)
    path = os.path.join(root, "llama-scorer")
    _perturbed(LlamaForSequenceClassification(config)).save_pretrained(path)
    return add_tokenizer(path)


def make_qwen2(root: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    path = os.path.join(root, "qwen2")
    # Small shards: the weights come from several files through model.safetensors.index.json.
    _perturbed(Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True))).save_pretrained(
        path, max_shard_size="60KB"
    )
    return path


# Each turn is "<|begin|>role\n content<|end|>\n"; the assistant's content and end token are what it generates.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|begin|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|begin|>assistant\\n' }}{% endif %}"
)
SAMPLE = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs.",
    "user assistant system: how are you? I am fine, thank you.",
    "def main():\n    return 42\n",
] * 20


def add_tokenizer(path: str) -> str:
    """A byte-level BPE tokenizer trained on SAMPLE (vocabulary <= SHAPE's), with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE["vocab_size"],
        special_tokens=["<|begin|>", "<|end|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SAMPLE, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin|>",
        "eos_token": "<|end|>",
        "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


def make_mistral(root: str) -> str:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    path = os.path.join(root, "mistral")
    # A window wider than the tested sequences: within it, sliding-window attention is full attention.
    _perturbed(MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=128))).save_pretrained(path)
    return path


# One tiny model of each native family beyond Llama, Qwen2 and Mistral, each with the options that make its
# family what it is switched on (a window shorter than the tested sequences, layers of both kinds, multipliers
# away from 1), built from the family's own config class.
FAMILY_SHAPE = {**SHAPE, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 24, "sliding_window": 8, "query_pre_attn_scalar": 20, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0, "num_hidden_layers": 3}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24, "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 8}),  # every layer windowed
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1]}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
        "logits_scaling": 4.0}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "output_router_logits": True, "router_aux_loss_coef": 0.02}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
        "router_aux_loss_coef": 0.02, "sliding_window": 8}),
}


def make_family(root: str, name: str) -> str:
    """A tiny random `name` model (a key of FAMILIES) saved in `root/name`, every tensor perturbed (norm
    weights, biases and routers included) so that each one counts."""
    import transformers

    config_class, model_class, options = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**FAMILY_SHAPE, **options})
    path = os.path.join(root, name)
    _perturbed(getattr(transformers, model_class)(config)).save_pretrained(path)
    return path


def make_named(root: str, name: str) -> str:
    """A tiny model of any family of trainer/config/families.py (Llama, Qwen2 and Mistral by their makers above, the
    rest from FAMILIES) with the tokenizer, in `root/name`; made once, found after."""
    path = os.path.join(root, name)
    if not os.path.isdir(path):
        makers = {"llama": make_llama, "qwen2": make_qwen2, "mistral": make_mistral}
        add_tokenizer(makers[name](root) if name in makers else make_family(root, name))
    return path
