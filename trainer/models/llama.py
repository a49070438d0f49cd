"""The decoder every model of trainjob is: a Llama-style transformer (RMSNorm, RoPE, grouped-query attention,
a gated MLP) whose blocks take the options of the pretrained families (`trainer.config.families`: where the norms
sit, `(1 + w)` norms, q/k norms, biases, GeLU-tanh gates, multipliers, soft-capping, sliding-window layers
interleaved with global ones and their own RoPE base, layers without RoPE, mixtures of experts in
`trainer.models.moe`). Their defaults (`Options`) are Llama's.

It knows nothing of parallelism: strategies in `trainer.parallel` shard it from outside (context parallelism
through the `context_parallel` object they set, which splits the rows, exchanges keys and values and shares the
loss). Layers are
kept in a ModuleDict keyed by index so that their names stay stable under any wrapping. The head count
used in `forward` comes from the projection's local width, so tensor-parallel shards need no change.
The normalisation, rotary, gating and loss functions are attributes (PyTorch's by default) that
`trainer.models.kernels` can point at the Triton ops of `ops/`. Incremental decoding passes a
`trainer.models.kv_cache.KVCache` through `forward(..., cache=)`: it gives the positions and the mask of the new
tokens, and each attention layer appends its keys and values to its own slot of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from trainer.models import chunked
from trainer.models.moe import MoE, load_balancing


@dataclasses.dataclass
class Options:
    """The family options of the decoder (the `model` section's keys of the same names)."""

    family: str = "llama"
    head_dim: int | None = None
    attention_bias: str = "none"
    mlp_bias: bool = False
    qk_norm: str = "none"
    norm_placement: str = "pre"
    norm_offset: float = 0.0
    activation: str = "silu"
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: list | None = None
    rope_local_theta: float | None = None
    nope_layers: list = dataclasses.field(default_factory=list)
    n_experts: int = 0
    n_experts_per_token: int = 0
    moe_ffn_dim: int | None = None
    dense_layers: list = dataclasses.field(default_factory=list)
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False


OPTION_KEYS = tuple(f.name for f in dataclasses.fields(Options))


class RMSNorm(nn.Module):
    norm_fn = staticmethod(F.rms_norm)

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + self.offset if self.offset else self.weight  # Gemma: x_normed * (1 + w)
        return self.norm_fn(x, (x.shape[-1],), weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim), or (batch, seq, head_dim) for packed
    rows whose positions restart with each document; the "rotate half" convention."""
    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, softcap: float) -> torch.Tensor:
    """Attention whose scores pass through softcap * tanh(scores / softcap) before the softmax (Gemma 2), as
    transformers' eager attention computes it; `mask` None is causal."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        length, keys = q.shape[-2], k.shape[-2]
        mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def softcapped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    is_causal: bool = False, enable_gqa: bool = False, scale: float | None = None, *,
                    softcap: float) -> torch.Tensor:
    """`softcapped_attention` with scaled_dot_product_attention's signature (`attn_mask` None: causal; boolean, or
    additive: 0 where a key is read)."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask == 0
    return softcapped_attention(q, k, v, attn_mask, scale if scale is not None else q.shape[-1] ** -0.5, softcap)


class Attention(nn.Module):
    rope_fn = staticmethod(apply_rotary)
    attention_fn = staticmethod(F.scaled_dot_product_attention)

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, qkv_bias: bool = False, *, head_dim: int | None = None,
                 o_bias: bool = False, qk_norm: str = "none", eps: float = 1e-6, norm_offset: float = 0.0,
                 scale: float | None = None, softcap: float | None = None, use_rope: bool = True,
                 sliding: bool = False):
        super().__init__()
        self.head_dim = head_dim or dim // n_heads
        self.scale, self.softcap, self.use_rope, self.sliding = scale, softcap, use_rope, sliding
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm != "none":  # head: over each head's width; full: over the whole projection (OLMo 2)
            q_width, k_width = (self.head_dim, self.head_dim) if qk_norm == "head" else (
                n_heads * self.head_dim, n_kv_heads * self.head_dim)
            self.q_norm = RMSNorm(q_width, eps, norm_offset)
            self.k_norm = RMSNorm(k_width, eps, norm_offset)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries, keys and values of `x` (one product of the three weights in a CPU decode:
        `trainer.generate.packed_weights`)."""
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = self.projections(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(bsz, seq, -1, self.head_dim)
        k = k.view(bsz, seq, -1, self.head_dim)
        v = v.view(bsz, seq, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.rope_fn(q, k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv is not None:  # decoding: attend to every key so far (the cache gives the mask)
            k, v = kv.update(k, v)
        # mask (packed rows): (batch, 1, seq, seq) or one row's `Segments`, causal within each document; else
        # plain causal. Under context parallelism, the exchange of keys and values over the ranks of the row
        # (`trainer.parallel.context.Exchange`), which attends as `Segments` does.
        if isinstance(mask, Segments) and self.softcap is not None:
            mask = mask.dense()
        if hasattr(mask, "attend"):
            fn = self.attention_fn if self.softcap is None else functools.partial(softcapped_sdpa,
                                                                                  softcap=self.softcap)
            out = mask.attend(fn, q, k, v, enable_gqa=q.shape[1] != k.shape[1], scale=self.scale)
        elif self.softcap is not None:
            scale = self.scale if self.scale is not None else self.head_dim**-0.5
            out = softcapped_attention(q, k, v, mask, scale, self.softcap)
        else:
            out = self.attention_fn(q, k, v, attn_mask=mask, is_causal=mask is None,
                                    enable_gqa=q.shape[1] != k.shape[1], scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


def silu_and_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.silu(x) * y


def gelu_tanh_and_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh") * y


GATES = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


class FeedForward(nn.Module):
    gate_fn = staticmethod(silu_and_mul)

    def __init__(self, dim: int, hidden: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.activation = activation
        if activation != "silu":
            self.gate_fn = GATES[activation]
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`w1(x)` and `w3(x)` (one product of both weights in a CPU decode: `trainer.generate.packed_weights`)."""
        return self.w1(x), self.w3(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate_fn(*self.gate_and_up(x)))


class Block(nn.Module):
    """Attention then the MLP, each with a residual connection. The norms sit before them (`pre`), before and
    after (`sandwich`, Gemma) or after only (`post`, OLMo 2); the residual branches are scaled by
    `residual_multiplier` (Granite)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, eps: float, qkv_bias: bool = False,
                 *, attention: dict | None = None, feed_forward: nn.Module | None = None, placement: str = "pre",
                 norm_offset: float = 0.0, residual_multiplier: float = 1.0):
        super().__init__()
        self.residual_multiplier = residual_multiplier
        if placement != "post":
            self.attention_norm = RMSNorm(dim, eps, norm_offset)
        self.attention = Attention(dim, n_heads, n_kv_heads, qkv_bias, eps=eps, norm_offset=norm_offset,
                                   **(attention or {}))
        if placement != "pre":
            self.post_attention_norm = RMSNorm(dim, eps, norm_offset)
        if placement != "post":
            self.ffn_norm = RMSNorm(dim, eps, norm_offset)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(dim, ffn_dim)
        if placement != "pre":
            self.post_ffn_norm = RMSNorm(dim, eps, norm_offset)

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        norm = getattr(self, name, None)
        return x if norm is None else norm(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        # The mask goes by keyword: tensor parallelism's input plan covers the positional inputs.
        a = self._norm("post_attention_norm", self.attention(self._norm("attention_norm", x), cos, sin, mask=mask,
                                                             kv=kv))
        x = x + (a * self.residual_multiplier if self.residual_multiplier != 1.0 else a)
        f = self._norm("post_ffn_norm", self.feed_forward(self._norm("ffn_norm", x)))
        return x + (f * self.residual_multiplier if self.residual_multiplier != 1.0 else f)


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


def rope_tables(theta: float, head_dim: int, length: int, scaling: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (length, head_dim), of RoPE with base `theta`; `scaling`: llama3 or linear, or None."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        kind, params = scaling.get("rope_type", "llama3"), {k: v for k, v in scaling.items() if k != "rope_type"}
        inv_freq = inv_freq / params["factor"] if kind == "linear" else llama3_scaled(inv_freq, **params)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class TiedProjection(nn.Module):
    """The output projection of a model with tied embeddings: logits from the embedding matrix it is given.
    It holds no parameter (the embedding does); it is a module so that a strategy can place its inputs and
    output as it places an output layer's."""

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight)


def _feed_forward(dim: int, ffn_dim: int, index: int, o: Options) -> nn.Module:
    if o.n_experts and index not in o.dense_layers:
        experts = [FeedForward(dim, o.moe_ffn_dim or ffn_dim, o.activation, o.mlp_bias) for _ in range(o.n_experts)]
        return MoE(dim, experts, o.n_experts_per_token, o.norm_topk_prob)
    return FeedForward(dim, ffn_dim, o.activation, o.mlp_bias)


def _block(dim, n_heads, n_kv_heads, ffn_dim, eps, index: int, o: Options) -> Block:
    sliding = bool(o.layer_types) and o.layer_types[index] == "sliding_attention"
    attention = {
        "head_dim": o.head_dim, "o_bias": o.attention_bias == "all", "qk_norm": o.qk_norm, "scale": o.attention_scale,
        "softcap": o.attn_softcap, "use_rope": index not in o.nope_layers, "sliding": sliding,
    }
    return Block(dim, n_heads, n_kv_heads, ffn_dim, eps, o.attention_bias != "none", attention=attention,
                 feed_forward=_feed_forward(dim, ffn_dim, index, o), placement=o.norm_placement,
                 norm_offset=o.norm_offset, residual_multiplier=o.residual_multiplier)


class Segments:
    """The attention mask of one packed row (`data.packing=padding_free`): documents of `lengths` one after
    another, each attending causally within itself. Attention runs document by document (no (seq, seq) mask is
    made, nor scores across documents computed); `dense()` is the boolean mask, for the layers that need one
    (sliding windows, soft-capped scores)."""

    def __init__(self, documents: torch.Tensor, lengths: list[int] | None = None):
        self.documents = documents
        self.lengths = lengths or torch.unique_consecutive(documents[0], return_counts=True)[1].tolist()

    def dense(self) -> torch.Tensor:
        same = self.documents[:, :, None] == self.documents[:, None, :]
        return (same & torch.ones_like(same[0]).tril())[:, None]

    def attend(self, fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
        """`fn` (scaled_dot_product_attention's signature) causal over each document of (1, heads, seq, dim)."""
        parts = zip(q.split(self.lengths, 2), k.split(self.lengths, 2), v.split(self.lengths, 2), strict=True)
        return torch.cat([fn(a, b, c, attn_mask=None, is_causal=True, **kw) for a, b, c in parts], dim=2)


def _document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(batch, seq) positions of packed rows' tokens, restarting with each document."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def _positions(seq: int, device: torch.device, documents: torch.Tensor | None, cache):
    """(positions of the `seq` tokens, positions of the keys they attend to, the attention mask or None: causal).
    Plain rows give the slice 0..seq: the rotary tables are then read as views, with no index op. Packed rows
    give a (batch, 1, seq, seq) mask, one packed row `Segments`."""
    if cache is not None:
        return cache.positions, cache.key_positions, cache.mask
    if documents is None:
        return slice(0, seq), slice(0, seq), None
    positions = _document_positions(documents)
    if documents.shape[0] == 1:
        return positions, positions, Segments(documents)
    same = documents[:, :, None] == documents[:, None, :]
    mask = (same & torch.ones(seq, seq, dtype=torch.bool, device=device).tril())[:, None]
    return positions, positions, mask


def _window(mask: torch.Tensor | None, positions, keys, window: int, device: torch.device):
    """The mask of a sliding-window layer: `mask` (None: causal) and a key at most window - 1 positions back."""
    if isinstance(positions, slice):  # plain rows (`_positions`)
        positions = keys = torch.arange(positions.stop, device=device)
    if mask is None and positions.dim() == 1 and positions.shape[0] <= window:
        return None  # the window holds every earlier token: plain causal attention
    near = (positions[..., :, None] - keys[..., None, :]) < window
    if mask is None:
        length = positions.shape[-1]
        mask = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    near = near[None, None] if near.dim() == 2 else near[:, None]
    return mask & near


class Transformer(nn.Module):
    """The decoder. A pipeline stage (`trainer.parallel.pipeline`) is a copy with the parts of other stages set to
    None: without `tok_embeddings` its input is the previous stage's hidden states, without `norm` and an
    output layer it returns its hidden states."""

    # A function (hidden, weight, targets) -> loss that never materialises the logits, or None.
    fused_loss_fn = None
    # How many ranks split a later pipeline stage's input along the sequence (tensor parallelism's sequence
    # parallelism): the rotary tables cover the whole sequence. Set by `trainer.parallel.pipeline`.
    sequence_shards = 1
    # Context parallelism (strategy.cp > 1): a `trainer.parallel.context.ContextParallel` that splits each row over
    # the cp ranks, exchanges keys and values and shares the loss. Set by `trainer.parallel.parallelize`.
    context_parallel = None

    def __init__(self, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int,
                 vocab_size: int, max_seq_len: int, rope_theta: float, norm_eps: float,
                 tie_embeddings: bool, qkv_bias: bool = False, rope_scaling: dict | None = None, **options):
        super().__init__()
        o = Options(**options)
        if qkv_bias:
            o.attention_bias = "qkv"
        self.options = o
        self.dim, self.n_layers, self.n_heads = dim, n_layers, n_heads
        self.max_seq_len, self.rope_theta, self.rope_scaling = max_seq_len, rope_theta, rope_scaling
        self.family, self.final_softcap = o.family, o.final_softcap
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict(
            {str(i): _block(dim, n_heads, n_kv_heads, ffn_dim, norm_eps, i, o) for i in range(n_layers)}
        )
        self.norm = RMSNorm(dim, norm_eps, o.norm_offset)
        # Tied: no separate output layer; the embedding matrix projects back. Sharing one Parameter
        # between two modules would not survive `to_empty`, which re-creates each module's tensors.
        self.output = None if tie_embeddings else nn.Linear(dim, vocab_size, bias=False)
        self.tied_output = TiedProjection() if tie_embeddings else None
        head_dim = o.head_dim or dim // n_heads
        self.register_buffer("rope_cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_seq_len, head_dim), persistent=False)
        if o.rope_local_theta is not None:  # Gemma 3: the sliding layers' own base
            self.register_buffer("rope_local_cos", torch.empty(max_seq_len, head_dim), persistent=False)
            self.register_buffer("rope_local_sin", torch.empty(max_seq_len, head_dim), persistent=False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Fill the rotary tables in place (after `to_empty`, on whatever device the buffers are)."""
        head_dim = self.rope_cos.shape[-1]
        cos, sin = rope_tables(self.rope_theta, head_dim, self.max_seq_len, self.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        if self.options.rope_local_theta is not None:
            cos, sin = rope_tables(self.options.rope_local_theta, head_dim, self.max_seq_len, None)
            self.rope_local_cos.copy_(cos)
            self.rope_local_sin.copy_(sin)

    def hidden_states(self, tokens: torch.Tensor, documents: torch.Tensor | None = None,
                      cache=None) -> torch.Tensor:
        """The final normed hidden states, (batch, seq, dim), divided by `logits_scaling`: what the output
        projection reads. `documents` (batch, seq) numbers the documents packed into each row: attention stays
        within a document and positions restart with each. `cache` (a `KVCache` the new tokens were appended
        to): the tokens continue the ones it holds. Under context parallelism (`context_parallel`), this rank's share
        of each row's tokens, at their true positions."""
        o = self.options
        staged = self.tok_embeddings is None  # a later pipeline stage: `tokens` are the hidden states
        seq = tokens.shape[1] * self.sequence_shards if staged else tokens.shape[1]
        if self.context_parallel is not None and cache is None:  # this rank's share of each row
            positions, masks = self._context_split(seq, documents, tokens.device)
            tokens = self.context_parallel.split(tokens)
        else:
            positions, keys, mask = _positions(seq, tokens.device, documents, cache)
            dense = mask.dense() if isinstance(mask, Segments) and o.sliding_window else mask
            masks = {False: mask, True: _window(dense, positions, keys, o.sliding_window, tokens.device)
                     if o.sliding_window else mask}
        tables = {False: (self.rope_cos[positions], self.rope_sin[positions])}
        tables[True] = (self.rope_local_cos[positions], self.rope_local_sin[positions]) \
            if o.rope_local_theta is not None else tables[False]
        h = tokens if staged else self.tok_embeddings(tokens)
        if o.embedding_multiplier != 1.0 and not staged:  # in the model's dtype, as transformers scales Gemma's
            h = h * torch.tensor(o.embedding_multiplier, dtype=h.dtype)
        for i, layer in enumerate(self.layers.values()):
            sliding = layer.attention.sliding
            cos, sin = tables[sliding]
            extra = {} if masks[sliding] is None else {"mask": masks[sliding]}
            if cache is not None:
                extra["kv"] = cache.layers[i]
            h = layer(h, cos, sin, **extra)
        if self.norm is None:  # a pipeline stage before the last
            return h
        h = self.norm(h)
        return h / o.logits_scaling if o.logits_scaling != 1.0 else h

    def _context_split(self, seq: int, documents: torch.Tensor | None, device: torch.device):
        """(the true positions of this rank's tokens, each kind of layer's `Exchange`) under context parallelism."""
        cp, window = self.context_parallel, self.options.sliding_window
        positions = cp.positions(seq, device) if documents is None else cp.split(_document_positions(documents))
        masks = {False: cp.attention(seq, documents, None, device)}
        masks[True] = cp.attention(seq, documents, window, device) if window else masks[False]
        return positions, masks

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab, dim) matrix that turns hidden states into logits."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, cache=None, loss_fn=None) -> torch.Tensor:
        """The logits, or with `targets` the mean cross-entropy (computed in fp32, the logits never whole: the fused
        kernel under kernels=triton, else `chunked.cross_entropy`), plus a mixture of experts' load-balancing loss
        where `output_router_logits` asks for it. The loss is taken here, inside forward, so that wrappers' hooks
        (DDP, FSDP) see it. `loss_fn(hidden, output matrix, targets)` (as `projected` gives them; with
        `softcap=` the final soft-cap where the model has one), when given, is the loss instead (recipe=kd's
        divergence, dpo's and grpo's log-probabilities). `documents`, `cache`: see `hidden_states`. Under context
        parallelism the loss is this rank's share of the whole rows' mean (`ContextParallel.share`); `loss_fn` and the
        logits read the whole rows' hidden states, gathered back."""
        h = self.hidden_states(tokens, documents, cache)
        if self.output is None and self.tied_output is None:  # a pipeline stage before the last
            return h
        cp = self.context_parallel if cache is None else None
        if cp is not None and targets is not None and loss_fn is None:  # the rank's tokens' share of the mean
            logps = chunked.token_logps(*self.projected(h), cp.split(targets), softcap=self.final_softcap)
            return self._with_router_loss(cp.share(-logps.sum(), targets))
        if cp is not None:  # a recipe's own token losses, or the logits: over whole rows
            h = cp.gather(h)
        if loss_fn is not None:
            return loss_fn(*self.projected(h), targets, **self.cap)
        if targets is not None and self.fused_loss_fn is not None:
            return self._with_router_loss(self.fused_loss_fn(*self.projected(h), targets))
        if targets is not None:  # the logits a chunk of tokens at a time (`trainer.models.chunked`)
            return self._with_router_loss(chunked.cross_entropy(*self.projected(h), targets, **self.cap))
        logits = self.output(h) if self.output is not None else self.tied_output(h, self.tok_embeddings.weight)
        return chunked.capped(logits, self.final_softcap)

    @property
    def cap(self) -> dict:
        """The keyword that hands a loss over the output layer the final logits' soft-cap, where there is one."""
        return {} if self.final_softcap is None else {"softcap": self.final_softcap}

    def projected(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, output matrix) as the output layer multiplies them: train.qat's fake-quantised layer
        (torchao's FakeQuantizedLinear) rounds both first, differentiably, so the chunked losses see what it sees."""
        layer, weight = self.output, self.output_weight
        if getattr(layer, "activation_fake_quantizer", None) is not None:
            h = layer.activation_fake_quantizer(h)
        if getattr(layer, "weight_fake_quantizer", None) is not None:
            weight = layer.weight_fake_quantizer(weight)
        return h, weight

    def _with_router_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss`, plus router_aux_loss_coef x the load-balancing loss of the experts where asked; the experts'
        load goes to `moe_stats` (a metrics line's `moe/aux_loss` and `moe/expert_load_max`)."""
        if not self.options.n_experts:
            return loss
        layers = [m for m in self.modules() if isinstance(m, MoE)]
        if self.context_parallel is not None:  # the router's statistics over the whole rows
            for layer in layers:
                layer.router_logits = self.context_parallel.gather(layer.router_logits, dim=0)
        aux, load = load_balancing(layers)
        self.moe_stats = {"moe/aux_loss": aux.detach(), "moe/expert_load_max": load.max()}
        if not self.options.output_router_logits:
            return loss
        aux = aux * self.options.router_aux_loss_coef
        if isinstance(loss, DTensor):  # loss parallelism: every tensor-parallel rank holds the same routing
            aux = DTensor.from_local(aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
        return loss + aux
