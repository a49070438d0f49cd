"""The key/value cache of incremental decoding with our `Transformer`, for batches of left-padded rows.

Each step appends the new tokens' validity (`append`): the cache then holds the rotary positions of the new
tokens (count of real tokens before each, so a left-padded row starts at position 0 as an unpadded one does,
as `transformers` numbers them) and their attention mask (causal, padding keys hidden). Each attention
layer writes its keys and values into its own `LayerCache` slot, allocated on first use with the layer's
local head count, so a tensor-parallel shard caches only its own heads. Its tensors are allocated once, at the
whole batch and `max_len`; rows that have ended leave (`keep`): the rows still running move to the front of the
same tensors and the calls that follow read only them. Positions are counted on as tokens come (one column's
costs no pass over the cached ones). Under `model.impl=transformers` the keys and values are held instead by
transformers' own cache (`hf`, set by the model's first call), which `keep` shrinks to the same rows.

A batch's prompts can instead come first as one packed row (`append_packed`: their tokens one after another,
no padding, each attending within itself): the prefill then computes no padding, and each layer scatters the
keys and values into the left-padded rows that the one-column calls after it read (a prompt that several rows
share, as GRPO's generations of one prompt do, is computed once and cached in each).
"""

from __future__ import annotations

import torch

from trainer.models.llama import Segments


class LayerCache:
    """One attention layer's keys and values, (batch, kv_heads, max_len, head_dim) each."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values (batch, kv_heads, new, head_dim); return all of them so far
        (packed prompts: the ones given, which attend within each prompt)."""
        owner = self.owner
        if self.k is None:
            shape = (owner.batch, k.shape[1], owner.max_len, k.shape[3])
            # Zeros: packed prompts leave their rows' padding unwritten, and a masked key must still be finite.
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        if owner.packed is not None:
            rows, columns, source = owner.packed
            # Indexed on the leading dimensions of a (batch, max_len, heads, head_dim) view: the form of index_put
            # that the routed kernels (kernels=triton) take.
            self.k.transpose(1, 2)[rows, columns] = k[0].transpose(0, 1)[source]
            self.v.transpose(1, 2)[rows, columns] = v[0].transpose(0, 1)[source]
            return k, v
        start, end, rows = owner.start, owner.length, k.shape[0]
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
        self.start = self.length = self.batch = 0
        self.valid: torch.Tensor | None = None  # (batch, max_len): which cached tokens are real, not padding
        self.count: torch.Tensor | None = None  # (batch,): how many real tokens each row holds
        self.positions: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None  # (batch, length): where a sliding window measures from
        self.mask: torch.Tensor | None = None
        # Packed prompts: the (row, column) of each cached token and its index in the packed row.
        self.packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._positions: torch.Tensor | None = None  # (batch, max_len): every cached token's position
        # transformers' cache (a `Cache`) under model.impl=transformers: it, not `layers`, holds the keys and values.
        self.hf = None

    def _allocate(self, batch: int, device: torch.device) -> None:
        self.batch = batch
        self.valid = torch.zeros(batch, self.max_len, dtype=torch.bool, device=device)
        self._positions = torch.zeros(batch, self.max_len, dtype=torch.long, device=device)
        self.count = torch.zeros(batch, dtype=torch.long, device=device)

    def _take(self, new: int) -> None:
        if self.length + new > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens; {self.length} + {new} do not fit")
        self.start, self.length = self.length, self.length + new
        self.packed = None

    def append(self, valid: torch.Tensor) -> None:
        """Take the next tokens, `valid` (batch, new) saying which are real (False for left padding), before
        the forward that reads them; sets `positions` (batch, new), `key_positions` (batch, length) and `mask`
        (batch, 1, new, length)."""
        batch, new = valid.shape
        self._take(new)
        if self.valid is None:
            self._allocate(batch, valid.device)
        start, end = self.start, self.length
        self.valid[:batch, start:end] = valid
        seen = self.valid[:batch, :end]
        counted = valid.cumsum(1) if new > 1 else valid.long()
        self.positions = (self.count[:batch, None] + counted - 1).clamp(min=0)
        self.count[:batch] += counted[:, -1]
        self._positions[:batch, start:end] = self.positions
        self.key_positions = self._positions[:batch, :end]
        # A padding query still sees itself, so that no row of the mask is empty (SDPA would give NaN there);
        # no real token ever sees a padding key, so what a padding position computes goes nowhere.
        if new == 1:
            mask = seen.clone()
            mask[:, -1] = True
            self.mask = mask[:, None, None]
            return
        query = torch.arange(start, end, device=valid.device)[:, None]
        key = torch.arange(end, device=valid.device)[None, :]
        self.mask = (((key <= query)[None] & seen[:, None, :]) | (key == query)[None])[:, None]

    def append_packed(self, lengths: list[int], width: int, owners: torch.Tensor) -> None:
        """Take prompts of `lengths` tokens as one packed row (1, sum(lengths)), before the forward that reads
        it; row r of the batch is prompt `owners[r]` (a prompt many rows share is computed once), cached left
        padded to `width` columns, as `append` of the padded rows caches it."""
        self._take(width)
        device = owners.device
        self._allocate(len(owners), device)
        sizes = torch.tensor(lengths, device=device)
        starts = sizes.cumsum(0) - sizes
        prompt = torch.repeat_interleave(torch.arange(len(lengths), device=device), sizes)
        positions = torch.arange(int(sizes.sum()), device=device) - starts[prompt]
        # Each row's cached tokens: the row, its column, and its token in the packed row.
        counts = sizes[owners]
        rows = torch.repeat_interleave(torch.arange(len(owners), device=device), counts)
        offset = torch.arange(int(counts.sum()), device=device) - (counts.cumsum(0) - counts)[rows]
        columns = width - counts[rows] + offset
        self.packed = rows, columns, starts[owners][rows] + offset
        self.valid[rows, columns] = True
        self._positions[rows, columns] = offset
        self.count.copy_(counts)
        self.positions = self.key_positions = positions[None]
        self.mask = Segments(prompt[None], list(lengths))

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the rows `rows` (indices into the rows held now, ascending), in that order, in place: the
        next `append` takes `len(rows)` rows."""
        n = len(rows)
        self.valid[:n, : self.length] = self.valid[rows, : self.length]
        self._positions[:n, : self.length] = self._positions[rows, : self.length]
        self.count[:n] = self.count[rows]
        self.valid, self._positions, self.count = self.valid[:n], self._positions[:n], self.count[:n]
        for layer in self.layers:
            layer.keep(rows)
        if self.hf is not None:
            # Beam search's selection of batch rows, which every kind of transformers' cache layer has (linear
            # attention's lacks batch_select_indices).
            self.hf.reorder_cache(rows)
