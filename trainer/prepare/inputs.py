"""The shared input checks: what only the data, the checkpoints or the cache nodes can tell (too few rows for a
global batch, token ids beyond the vocabulary, a model too large for this machine, a checkpoint of another
model, nodes that do not answer). Each is a ConfigError before the first step: one line, exit code 2.

The driver runs `check` where the ranks read this machine's data (`trainer.prepare.preflight`); a rank runs it in
its own process (`trainer.worker`), unless the driver already ran it there (the default run, whose worker
is called in the driver's process). This is the one module of the rank side the driver imports.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer import models
from trainer.checkpoint import resume
from trainer.config import CACHE_KEYS, Config, ConfigError, Degrees
from trainer.data.kinds import KINDS
from trainer.data.splits import needs_corpus, split_dataset

# Bytes per parameter a rank holds at the least: fp32 weights, gradients and AdamW's two moments.
BYTES_PER_PARAM = 16


def check_memory(cfg: Config, dims: Degrees) -> None:
    """Raise ConfigError when this machine cannot hold the model's weights, gradients and optimizer state
    (sharded over dp_shard x tp ranks, split over pp stages, shared by this machine's ranks): a model that
    cannot fit is a config error, not an allocation failure minutes later."""
    m = cfg.model
    try:
        params = models.count_params(m)
    except RuntimeError:  # a tensor whose size in bytes overflows int64
        raise ConfigError("model", f"dim={m.dim}, ffn_dim={m.ffn_dim}, vocab_size={m.vocab_size}",
                          "makes a tensor too large to address: choose smaller model.* sizes") from None
    per_rank = params * BYTES_PER_PARAM / (dims.dp_shard * dims.tp * dims.pp)
    if torch.cuda.is_available():
        available, where = torch.cuda.mem_get_info()[1], "GPU"
    else:
        ranks_here = cfg.runtime.nproc_per_node if cfg.runtime is not None and cfg.runtime.nproc_per_node else 1
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / ranks_here
        where = "share of this machine's memory"
    if per_rank > available:
        raise ConfigError("model", f"{params / 1e9:.3g}B parameters",
                          f"needs at least {per_rank / 2**30:.1f} GiB per rank for weights, gradients and AdamW "
                          f"state, more than a rank's {where} ({available / 2**30:.1f} GiB): choose a smaller "
                          "model.* or shard it over more ranks (strategy=fsdp2)")


@dataclass(frozen=True)
class Checked:
    """What `check` found for a job: the corpus directory (None when every split comes from cache nodes), and the
    checkpoint it starts from (`resume.decide`'s decision, checked; None: a fresh start)."""

    corpus: str | None
    start: resume.Start | None


def check(cfg: Config, dims: Degrees,
          decide: Callable[[Config], resume.Start | None] = resume.decide_at_launch) -> Checked:
    """Build or find the corpus and check everything the job will read before its first step: the corpus
    (rows for one global batch, token ids), the cache nodes, the checkpoint store (`resume.reach`) and the
    checkpoint it resumes from, which `decide` works out last (`trainer.checkpoint.resume.decide_at_launch` in the
    driver's process; `agreed` on the ranks, where rank 0 decides for all). Raises ConfigError."""
    check_memory(cfg, dims)
    kind = KINDS[cfg.data.name]
    corpus = kind.prepare(cfg) if needs_corpus(cfg.data) else None
    if corpus is not None:
        kind.check(corpus, cfg)
    for split, key in CACHE_KEYS.items():
        if getattr(cfg.data.cache, key):
            split_dataset(cfg.data, split, corpus, global_batch_size=cfg.train.global_batch_size,
                          rank=0, world_size=dims.dp_size, loop=False)
    resume.reach(cfg)
    start = decide(cfg)
    resume.check(start, cfg)
    return Checked(corpus, start)
