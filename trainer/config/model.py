"""The `model` section: the transformer's sizes (`model=debug|llama3_8b|hf|...`)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from trainer.config.checks import positive, require

# The byte-level tokenizer's vocabulary (`trainer.data.tokenizer`): the 256 bytes, then BOS, EOS and PAD.
BYTE_VOCAB_SIZE = 259


@dataclass
class ModelConfig:
    name: str = MISSING
    # model=hf: a Hugging Face model directory; the keys below are then read from its config.json.
    path: str | None = None
    # model=hf: the code that runs it, native (trainjob's decoder) or transformers (the directory's own modeling
    # code); unset, config.json chooses (trainer.config.hf_impl).
    impl: str | None = None
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int = MISSING
    ffn_dim: int = MISSING
    vocab_size: int = BYTE_VOCAB_SIZE
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def check(self) -> None:
        positive(self, "model", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                 "max_seq_len", "rope_theta", "norm_eps", "init_std")
        require(self.impl in (None, "native", "transformers"), "model.impl", self.impl,
                "must be native or transformers (or unset: chosen from model=hf's config.json)")
        require(self.impl != "transformers" or self.name == "hf", "model.impl", self.impl,
                f"runs a Hugging Face directory through transformers: use model=hf model.path=<directory> "
                f"(model={self.name} is trainjob's own decoder)")
        if self.impl == "transformers":
            return  # the rules below are our decoder's
        require(self.dim % self.n_heads == 0, "model.dim", self.dim,
                f"must be divisible by model.n_heads={self.n_heads}")
        require((self.dim // self.n_heads) % 2 == 0, "model.dim", self.dim,
                f"model.dim / model.n_heads must be even for rotary embeddings (is {self.dim / self.n_heads:g})")
        require(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
                f"must divide model.n_heads={self.n_heads}")
