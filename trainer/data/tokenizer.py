"""A byte-level tokenizer: token ids 0-255 are the UTF-8 bytes, then BOS, EOS and PAD. Needs no download."""

from __future__ import annotations

import numpy as np

from trainer.config.model import BYTE_VOCAB_SIZE as VOCAB_SIZE  # noqa: F401  (the ids the corpora hold)

BOS, EOS, PAD = 256, 257, 258


def encode(text: str | bytes, bos: bool = False, eos: bool = True) -> np.ndarray:
    """Token ids (uint16) of `text`, optionally framed by BOS/EOS."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
    parts = ([np.array([BOS], np.uint16)] if bos else []) + [ids] + ([np.array([EOS], np.uint16)] if eos else [])
    return np.concatenate(parts)


def decode(ids) -> str:
    """Text of `ids`, dropping the special tokens; invalid UTF-8 becomes U+FFFD."""
    raw = bytes(int(i) for i in ids if int(i) < 256)
    return raw.decode("utf-8", errors="replace")
