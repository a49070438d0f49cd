"""A Llama-style decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

It knows nothing of parallelism: strategies in `trainer.parallel` shard it from outside. Layers are
kept in a ModuleDict keyed by index so that their names stay stable under any wrapping. The head count
used in `forward` comes from the projection's local width, so tensor-parallel shards need no change.
Pretrained families add q/k/v biases (Qwen2) and Llama 3.1's RoPE scaling (`trainer.models.hf`).
The normalisation, rotary, gating and loss functions are attributes (PyTorch's by default) that
`trainer.models.kernels` can point at the Triton ops of `ops/`. Incremental decoding passes a
`trainer.models.kv_cache.KVCache` through `forward(..., cache=)`: it gives the positions and the mask of the new
tokens, and each attention layer appends its keys and values to its own slot of it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models import chunked


class RMSNorm(nn.Module):
    norm_fn = staticmethod(F.rms_norm)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, (x.shape[-1],), self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim), or (batch, seq, head_dim) for packed
    rows whose positions restart with each document; the "rotate half" convention."""
    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    rope_fn = staticmethod(apply_rotary)
    attention_fn = staticmethod(F.scaled_dot_product_attention)

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, qkv_bias: bool = False):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = self.rope_fn(q, k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv is not None:  # decoding: attend to every key so far (the cache gives the mask)
            k, v = kv.update(k, v)
        # mask (packed rows): (batch, 1, seq, seq), causal within each document; else plain causal.
        out = self.attention_fn(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1],
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


def silu_and_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.silu(x) * y


class FeedForward(nn.Module):
    gate_fn = staticmethod(silu_and_mul)

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate_fn(self.w1(x), self.w3(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, eps: float, qkv_bias: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps)
        self.attention = Attention(dim, n_heads, n_kv_heads, qkv_bias)
        self.ffn_norm = RMSNorm(dim, eps)
        self.feed_forward = FeedForward(dim, ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        # The mask goes by keyword: tensor parallelism's input plan covers the positional inputs.
        x = x + self.attention(self.attention_norm(x), cos, sin, mask=mask, kv=kv)
        return x + self.feed_forward(self.ffn_norm(x))


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class TiedProjection(nn.Module):
    """The output projection of a model with tied embeddings: logits from the embedding matrix it is given.
    It holds no parameter (the embedding does); it is a module so that a strategy can place its inputs and
    output as it places an output layer's."""

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight)


class Transformer(nn.Module):
    # A function (hidden, weight, targets) -> loss that never materialises the logits, or None.
    fused_loss_fn = None

    def __init__(self, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int,
                 vocab_size: int, max_seq_len: int, rope_theta: float, norm_eps: float,
                 tie_embeddings: bool, qkv_bias: bool = False, rope_scaling: dict | None = None):
        super().__init__()
        self.dim, self.n_layers, self.n_heads = dim, n_layers, n_heads
        self.max_seq_len, self.rope_theta, self.rope_scaling = max_seq_len, rope_theta, rope_scaling
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict(
            {str(i): Block(dim, n_heads, n_kv_heads, ffn_dim, norm_eps, qkv_bias) for i in range(n_layers)}
        )
        self.norm = RMSNorm(dim, norm_eps)
        # Tied: no separate output layer; the embedding matrix projects back. Sharing one Parameter
        # between two modules would not survive `to_empty`, which re-creates each module's tensors.
        self.output = None if tie_embeddings else nn.Linear(dim, vocab_size, bias=False)
        self.tied_output = TiedProjection() if tie_embeddings else None
        head_dim = dim // n_heads
        self.register_buffer("rope_cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_seq_len, head_dim), persistent=False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Fill the rotary tables in place (after `to_empty`, on whatever device the buffers are)."""
        head_dim = self.rope_cos.shape[-1]
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if self.rope_scaling is not None:
            inv_freq = llama3_scaled(inv_freq, **self.rope_scaling)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())

    def hidden_states(self, tokens: torch.Tensor, documents: torch.Tensor | None = None,
                      cache=None) -> torch.Tensor:
        """The final normed hidden states, (batch, seq, dim): what the output projection reads. `documents`
        (batch, seq) numbers the documents packed into each row: attention stays within a document and
        positions restart with each. `cache` (a `KVCache` the new tokens were appended to): the tokens
        continue the ones it holds."""
        seq = tokens.shape[1]
        mask = None
        if cache is not None:
            cos, sin = self.rope_cos[cache.positions], self.rope_sin[cache.positions]
            h = self.tok_embeddings(tokens)
            for i, layer in enumerate(self.layers.values()):
                h = layer(h, cos, sin, cache.mask, kv=cache.layers[i])
            return self.norm(h)
        if documents is None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            index = torch.arange(seq, device=tokens.device).expand_as(documents)
            starts = torch.ones_like(documents, dtype=torch.bool)
            starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
            positions = index - torch.where(starts, index, 0).cummax(dim=1).values
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            same = documents[:, :, None] == documents[:, None, :]
            mask = (same & torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril())[:, None]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask) if mask is not None else layer(h, cos, sin)
        return self.norm(h)

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab, dim) matrix that turns hidden states into logits."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, cache=None, loss_fn=None) -> torch.Tensor:
        """The logits, or with `targets` the mean cross-entropy (computed in fp32, the logits never whole: the fused
        kernel under kernels=triton, else `chunked.cross_entropy`). The loss is taken here, inside forward, so that
        wrappers' hooks (DDP, FSDP) see it. `loss_fn(hidden, output matrix, targets)` (as `projected` gives them),
        when given, is the loss instead (recipe=kd's divergence, dpo's and grpo's log-probabilities). `documents`,
        `cache`: see `hidden_states`."""
        h = self.hidden_states(tokens, documents, cache)
        if loss_fn is not None:
            return loss_fn(*self.projected(h), targets)
        if targets is not None and self.fused_loss_fn is not None:
            return self.fused_loss_fn(*self.projected(h), targets)
        if targets is not None:  # the logits a chunk of tokens at a time (`trainer.models.chunked`)
            return chunked.cross_entropy(*self.projected(h), targets)
        return self.output(h) if self.output is not None else self.tied_output(h, self.tok_embeddings.weight)

    def projected(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, output matrix) as the output layer multiplies them: train.qat's fake-quantised layer
        (torchao's FakeQuantizedLinear) rounds both first, differentiably, so the chunked losses see what it sees."""
        layer, weight = self.output, self.output_weight
        if getattr(layer, "activation_fake_quantizer", None) is not None:
            h = layer.activation_fake_quantizer(h)
        if getattr(layer, "weight_fake_quantizer", None) is not None:
            weight = layer.weight_fake_quantizer(weight)
        return h, weight
