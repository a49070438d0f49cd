"""The key/value cache of incremental decoding with our `Transformer`, for batches of left-padded rows.

Each step appends the new tokens' validity (`append`): the cache then holds the rotary positions of the new
tokens (count of real tokens before each, so a left-padded row starts at position 0 as an unpadded one does,
as `transformers` numbers them) and their attention mask (causal, padding keys hidden). Each attention
layer writes its keys and values into its own `LayerCache` slot, allocated on first use with the layer's
local head count, so a tensor-parallel shard caches only its own heads. Its tensors are allocated once, at the
whole batch and `max_len`; rows that have ended leave (`keep`): the rows still running move to the front of the
same tensors and the calls that follow read only them.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys and values, (batch, kv_heads, max_len, head_dim) each."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values (batch, kv_heads, new, head_dim); return all of them so far."""
        start, end, rows = self.owner.start, self.owner.length, k.shape[0]
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.owner.max_len, k.shape[3])
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        self.k[:rows, :, start:end] = k
        self.v[:rows, :, start:end] = v
        return self.k[:rows, :, :end], self.v[:rows, :, :end]

    def keep(self, rows: torch.Tensor) -> None:
        if self.k is not None:
            end = self.owner.length
            self.k[: len(rows), :, :end] = self.k[rows, :, :end]
            self.v[: len(rows), :, :end] = self.v[rows, :, :end]


class KVCache:
    """The cache of a whole model (`n_layers` layers) for rows of at most `max_len` tokens."""

    def __init__(self, n_layers: int, max_len: int):
        self.max_len = max_len
        self.layers = [LayerCache(self) for _ in range(n_layers)]
        self.start = self.length = 0
        self.valid: torch.Tensor | None = None  # (batch, max_len): which cached tokens are real, not padding
        self.positions: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None  # (batch, length): where a sliding window measures from
        self.mask: torch.Tensor | None = None

    def append(self, valid: torch.Tensor) -> None:
        """Take the next tokens, `valid` (batch, new) saying which are real (False for left padding), before
        the forward that reads them; sets `positions` (batch, new), `key_positions` (batch, length) and `mask`
        (batch, 1, new, length)."""
        batch, new = valid.shape
        if self.length + new > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens; {self.length} + {new} do not fit")
        if self.valid is None:
            self.valid = torch.zeros(batch, self.max_len, dtype=torch.bool, device=valid.device)
        self.start, self.length = self.length, self.length + new
        self.valid[:, self.start : self.length] = valid
        seen = self.valid[:, : self.length]
        self.key_positions = (seen.cumsum(1) - 1).clamp(min=0)
        self.positions = self.key_positions[:, self.start :]
        query = torch.arange(self.start, self.length, device=valid.device)[:, None]
        key = torch.arange(self.length, device=valid.device)[None, :]
        # A padding query still sees itself, so that no row of the mask is empty (SDPA would give NaN there);
        # no real token ever sees a padding key, so what a padding position computes goes nowhere.
        mask = ((key <= query)[None] & seen[:, None, :]) | (key == query)[None]
        self.mask = mask[:, None]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the rows `rows` (indices into the rows held now, ascending), in that order, in place: the
        next `append` takes `len(rows)` rows."""
        self.valid[: len(rows), : self.length] = self.valid[rows, : self.length]
        self.valid = self.valid[: len(rows)]
        for layer in self.layers:
            layer.keep(rows)
