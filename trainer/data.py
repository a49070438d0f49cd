"""Training data: a text source becomes fixed-length token rows in Parquet (built once, cached), then loaders.

Sources: `stdlib`, the Python standard library's own source files (real text on every machine), and
`parquet`, a user's files with a text column or a token-id list column. Each document is tokenized,
ends with EOS, and goes to the eval split when a hash of its id says so (so no document straddles the
splits); each split's token stream is cut into rows of `seq_len + 1` tokens (inputs and shifted targets)
that overlap by one token. The result lives in `<cache_dir>/corpus/<name>-<key>/{train,eval}/*.parquet`,
where the key hashes the source's fingerprint and the settings, so a change rebuilds it.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import zlib
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from datacache.local import parquet_files
from trainer.models import tokenizer

log = logging.getLogger(__name__)
ROWS_PER_SHARD = 8192


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    return sorted(f for f in files if "site-packages" not in f.split(os.sep))


def _fingerprint(cfg) -> dict:
    if cfg.name == "stdlib":
        files = _stdlib_files()
        return {"python": sys.version.split()[0], "files": len(files),
                "bytes": sum(os.path.getsize(f) for f in files)}
    files = parquet_files(cfg.path)
    if not files:
        raise FileNotFoundError(f"data.path={cfg.path!r}: no Parquet files there")
    return {"files": [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in files],
            "text_column": cfg.text_column, "tokens_column": cfg.tokens_column}


def _documents(cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(document id, token ids ending in EOS) for every document of the source, in a fixed order."""
    if cfg.name == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        for path in _stdlib_files():
            with open(path, "rb") as f:
                yield os.path.relpath(path, root), tokenizer.encode(f.read())
        return
    column = cfg.tokens_column or cfg.text_column
    for path in parquet_files(cfg.path):
        pf = pq.ParquetFile(path)
        if column not in pf.schema_arrow.names:
            raise KeyError(f"{path}: no column {column!r}; it has {', '.join(pf.schema_arrow.names)}")
        row = 0
        for batch in pf.iter_batches(columns=[column]):
            for value in batch.column(0).to_pylist():
                if value is not None:
                    ids = (np.append(np.asarray(value, dtype=np.uint16), tokenizer.EOS) if cfg.tokens_column
                           else tokenizer.encode(value))
                    yield f"{path}:{row}", ids
                row += 1


def _write_rows(stream: list[np.ndarray], seq_len: int, out_dir: str) -> int:
    os.makedirs(out_dir)
    tokens = np.concatenate(stream) if stream else np.zeros(0, np.uint16)
    n = max(0, (len(tokens) - 1) // seq_len)
    if n == 0:
        rows = np.zeros((0, seq_len + 1), np.uint16)
    else:
        rows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len][:n]
    # At least one shard, so that an empty split reads back as zero rows rather than a missing file.
    for i, start in enumerate(range(0, max(n, 1), ROWS_PER_SHARD)):
        chunk = np.ascontiguousarray(rows[start:start + ROWS_PER_SHARD])
        values = pa.array(chunk.reshape(-1), type=pa.uint16())
        table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(values, seq_len + 1)})
        pq.write_table(table, os.path.join(out_dir, f"shard-{i:05d}.parquet"))
    return n


def prepare(cfg) -> str:
    """The corpus directory for `cfg` (a DataConfig), building it first if it is missing."""
    settings = {"name": cfg.name, "seq_len": cfg.seq_len, "eval_percent": cfg.eval_percent,
                "source": _fingerprint(cfg), "format": 1}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    root = os.path.join(os.path.expanduser(cfg.cache_dir), "corpus")
    target = os.path.join(root, f"{cfg.name}-{key}")
    if os.path.isdir(target):
        return target
    os.makedirs(root, exist_ok=True)
    # One builder at a time (ranks and sweep jobs share the cache); the others wait and then reuse it.
    with open(os.path.join(root, f".{cfg.name}-{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(target):
            return target
        log.info("tokenizing the %s corpus into %s (once)", cfg.name, target)
        tmp = tempfile.mkdtemp(prefix=f".{cfg.name}-{key}-", dir=root)
        try:
            splits: dict[str, list[np.ndarray]] = {"train": [], "eval": []}
            for doc_id, ids in _documents(cfg):
                in_eval = zlib.crc32(doc_id.encode()) % 10_000 < cfg.eval_percent * 100
                splits["eval" if in_eval else "train"].append(ids)
            counts = {name: _write_rows(docs, cfg.seq_len, os.path.join(tmp, name))
                      for name, docs in splits.items()}
            with open(os.path.join(tmp, "corpus.json"), "w") as f:
                json.dump({**settings, "rows": counts}, f, indent=2)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("corpus rows: %s", counts)
    return target
