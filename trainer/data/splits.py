"""Where each split's batches come from: streamed from the cache nodes named for it (`data.cache.endpoints`,
`data.cache.eval_endpoints`), else read from the local corpus."""

from __future__ import annotations

import os

import pyarrow as pa

from datacache import DataCacheError, StreamingDataset
from datacache.planned import PlannedDataset
from trainer.config import CACHE_KEYS
from trainer.data.corpus import eval_rows
from trainer.data.kinds import KINDS
from trainer.errors import ConfigError


def needs_corpus(data_cfg) -> bool:
    """Whether some split is read from the local corpus (not every split comes from cache nodes)."""
    return not all(getattr(data_cfg.cache, key) for key in CACHE_KEYS.values())


def trains_without_eval(data_cfg, corpus: str | None, rows_per_step: int) -> bool:
    """Whether the run has no eval: `data.eval_percent` unset left the local eval split fewer rows than a step
    takes, `rows_per_step` (small data; the input checks said so in one line; an explicit share that does is
    refused there)."""
    if data_cfg.cache.eval_endpoints or getattr(data_cfg, "eval_percent", None) is not None or corpus is None:
        return False
    return eval_rows(corpus) < rows_per_step


def split_dataset(data_cfg, split: str, corpus: str | None, **kw) -> PlannedDataset:
    """A split's batches: streamed from the cache nodes named for it, else read from the local corpus."""
    key = CACHE_KEYS[split]
    endpoints = list(getattr(data_cfg.cache, key))
    if not endpoints:
        return KINDS[data_cfg.name].dataset(os.path.join(corpus, split), **kw)
    try:
        data = StreamingDataset(endpoints, token=data_cfg.cache.token, prefetch=data_cfg.cache.prefetch,
                                readers=data_cfg.cache.readers, tls_root_cert=data_cfg.cache.tls_root_cert, **kw)
        rows, _ = data.schema.field("tokens").type, data.plan  # the nodes are asked what they hold
    except (DataCacheError, ValueError) as e:  # unreachable nodes; fewer rows than one global batch
        raise ConfigError(f"data.cache.{key}", endpoints, str(e)) from None
    if not (pa.types.is_fixed_size_list(rows) and rows.list_size == data_cfg.seq_len + 1):
        raise ConfigError(f"data.cache.{key}", endpoints, f"the nodes hold {split} rows of type {rows}; "
                          f"data.seq_len={data_cfg.seq_len} needs rows of {data_cfg.seq_len + 1} token ids")
    return data
