"""`data.packing`: how a micro-batch of padded chat or preference rows reaches the model. The corpus keeps each
conversation in a row of `data.seq_len + 1` tokens with its real length (`trainer.data.chat`); a micro-batch is

    padding_free  the rows' real input tokens one after another in one row (TRL's `padding_free`): positions
                  restart with each conversation and attention never crosses from one to the next (the
                  model's `documents`), so no position is padding;
    longest       the rows cut to the longest real row of the micro-batch (rounded up to a multiple of the
                  tensor-parallel degree);
    max_length    the rows as stored, every one data.seq_len wide.

Each gives the same losses: attention is causal, so a row's positions after its real tokens change nothing
before them, and the targets are the padded rows' own. `unpack` puts a micro-batch's per-token values (the
log-probabilities dpo, grpo and rloo take) back where the padded rows hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.models.chunked import IGNORE


def choose(packing: str | None, pipeline: bool) -> str:
    """The packing of a run: `data.packing`, or unset the fastest that is exact (padding_free; max_length under a
    pipeline, whose stages take one shape)."""
    return packing or ("max_length" if pipeline else "padding_free")


def input_lengths(lengths: torch.Tensor | None, rows: int, width: int) -> torch.Tensor:
    """(rows,) real input positions of each row: its real tokens, at most `width` (the inputs are the row's
    tokens but the last); every position where `lengths` is None (token rows carry no padding)."""
    if lengths is None:
        return torch.full((rows,), width, dtype=torch.long)
    return lengths.reshape(rows).long().clamp(max=width)


@dataclass
class Packed:
    """A micro-batch as the model takes it: `tokens` (rows, width + 1), whose inputs are tokens[:, :-1],
    `target` (rows, width), `documents` (rows, width + 1) numbering the conversations of a packed row or None,
    `keep` (the padded rows' positions that the packed row holds, in order) to `unpack` by, and `seq` the padded
    rows' width (the inputs' of max_length)."""

    tokens: torch.Tensor
    target: torch.Tensor
    documents: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    seq: int | None = None

    @property
    def inputs_documents(self) -> torch.Tensor | None:
        return None if self.documents is None else self.documents[:, :-1]


def collate(tokens: torch.Tensor, target: torch.Tensor, real: torch.Tensor, packing: str, multiple: int = 1) -> Packed:
    """The micro-batch of padded rows `tokens` (rows, seq + 1) with `target` (rows, seq), whose rows hold `real`
    (rows,) real input positions each, as `packing` gives it. A packed row's width is a multiple of `multiple`
    (tensor parallelism's sequence split): the positions added attend only to themselves and count no target."""
    rows, seq = target.shape
    if packing == "max_length" or int(real.min()) == seq:
        return Packed(tokens, target, seq=seq)
    if packing == "longest":
        width = min(-(-int(real.max()) // multiple) * multiple, seq)
        return Packed(tokens[:, : width + 1], target[:, :width], seq=seq)
    keep = torch.arange(seq, device=real.device)[None] < real[:, None]
    total = int(real.sum())
    extra = -total % multiple
    documents = torch.repeat_interleave(torch.arange(rows), real.cpu())
    device = tokens.device
    keep = keep.to(device)
    inputs = torch.cat([tokens[:, :-1][keep], tokens.new_zeros(extra + 1)])
    documents = torch.cat([documents, torch.full((extra + 1,), rows)]).to(device)
    packed_target = torch.cat([target[keep], target.new_full((extra,), IGNORE)])
    return Packed(inputs[None], packed_target[None], documents[None], keep, seq)


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-token `values` of the model's inputs (1, width packed, or rows, width) at the padded rows' positions
    (rows, seq), 0 at padding."""
    if packed.keep is None:
        if packed.seq is None or values.shape[1] == packed.seq:
            return values
        return torch.nn.functional.pad(values, (0, packed.seq - values.shape[1]))
    out = values.new_zeros(packed.keep.shape)
    out[packed.keep] = values[0, : int(packed.keep.sum())]
    return out

