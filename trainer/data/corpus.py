"""A corpus: a source's documents become fixed-length token rows in Parquet, built once and cached; and the
checks of a built corpus. `build_once` is every data kind's build (the chat and prompt kinds' too).

The text sources, each a module of its own (`SOURCES`): `trainer.data.stdlib`, the Python standard library's own
source files (real text on every machine), and `trainer.data.parquet`, a user's files with a text column or a
token-id list column. Each document is tokenized,
ends with EOS, and goes to the eval split when a hash of its id says so (so no document straddles the
splits); each split's token stream is cut into rows of `seq_len + 1` tokens (inputs and shifted targets)
that overlap by one token. The result lives in `<cache_dir>/corpus/<name>-<key>/{train,eval}/*.parquet`,
where the key hashes the source's fingerprint and the settings, so a change rebuilds it.

A source that cannot make a corpus (no files, a column of the wrong type, token ids that do not fit the
uint16 rows) raises ConfigError naming the key; `check_corpus` says whether a built corpus can feed a job.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainer.config import CACHE_KEYS, ConfigError
from trainer.data import parquet, stdlib

log = logging.getLogger(__name__)
# The text sources a corpus is built from, by `data.name`: each gives its fingerprint and its documents.
SOURCES = {"stdlib": stdlib, "parquet": parquet}
ROWS_PER_SHARD = 8192

# data.eval_percent unset: this share of the documents is held out, and a split too small for one global batch
# means a run without eval (said in one line) rather than a refusal, as TRL trains without an eval set.
DEFAULT_EVAL_PERCENT = 2.0


def eval_share(data) -> float:
    """The percent of documents the eval split holds: `data.eval_percent`, or DEFAULT_EVAL_PERCENT unset."""
    value = getattr(data, "eval_percent", None)
    return DEFAULT_EVAL_PERCENT if value is None else float(value)


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


def corpus_damage(corpus: str) -> str | None:
    """What is wrong with the cached corpus directory `corpus` (no readable corpus.json, a split's shard
    missing, truncated or unreadable: a disk that filled, a hand that deleted), or None. Reads footers only."""
    try:
        with open(os.path.join(corpus, "corpus.json")) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"corpus.json cannot be read: {type(e).__name__}: {e}"
    for split, count in (rows.items() if isinstance(rows, dict) else []):
        found = 0
        for shard in sorted(glob.glob(os.path.join(glob.escape(os.path.join(corpus, split)), "*.parquet"))):
            try:
                found += pq.read_metadata(shard).num_rows
            except (OSError, pa.ArrowException) as e:
                return f"{shard} cannot be read: {e}"
        if isinstance(count, int) and found != count:
            return f"its {split} split holds {found} rows, corpus.json says {count} (a shard is missing)"
    return None


def corpus_key(corpus: str) -> str:
    """The fingerprint of the corpus in directory `<name>-<key>`: its key (a hash of source and settings)."""
    return os.path.basename(corpus).rsplit("-", 1)[1]


def _describe(source: dict) -> str:
    text = json.dumps(source, sort_keys=True)
    return text if len(text) <= 160 else text[:157] + "..."


def build_once(cache_dir: str, name: str, settings: dict, write: Callable[[str], dict],
               pinned: str | None = None) -> str:
    """The corpus directory for `settings` under `cache_dir`, built by `write(tmp)` when missing: it fills a
    fresh directory and returns what corpus.json adds to the settings (at least `rows`, `max_token_id`).
    One builder at a time (ranks and sweep jobs share the cache); the others wait and then reuse it, and a
    build that fails leaves nothing behind. With `pinned` (the key the driver checked, `data.fingerprint`),
    settings of another key raise ConfigError instead: this process would train on other data."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    root = os.path.join(os.path.expanduser(cache_dir), "corpus")
    if pinned and key != pinned:
        raise ConfigError("data.fingerprint", pinned, f"the driver checked that {name} corpus, and it is not "
                          f"in {root} here, where the source makes corpus {key} "
                          f"({_describe(settings['source'])}): mount the driver's data.cache_dir at the same path, "
                          "or give the ranks the same source")
    target = os.path.join(root, f"{name}-{key}")
    if os.path.isdir(target) and corpus_damage(target) is None:
        return target
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f".{name}-{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = corpus_damage(target) if os.path.isdir(target) else None
        if os.path.isdir(target) and problem is None:
            return target
        # Holding the lock, no other builder of this corpus is at work: what is left of one is a killed
        # build's temporary directory, or a damaged corpus, and goes.
        for stale in glob.glob(os.path.join(glob.escape(root), f".{name}-{key}-*")):
            shutil.rmtree(stale, ignore_errors=True)
        if problem:
            log.warning("the cached corpus %s is damaged (%s): building it again", target, problem)
            aside = tempfile.mkdtemp(prefix=f".{name}-{key}-damaged-", dir=root)
            os.rename(target, os.path.join(aside, "corpus"))
            shutil.rmtree(aside, ignore_errors=True)
        log.info("tokenizing the %s corpus into %s (once)", name, target)
        tmp = tempfile.mkdtemp(prefix=f".{name}-{key}-", dir=root)
        try:
            facts = write(tmp)
            with open(os.path.join(tmp, "corpus.json"), "w") as f:
                json.dump({**settings, **facts}, f, indent=2)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("corpus rows: %s", facts["rows"])
    return target


def prepare(cfg) -> str:
    """The corpus directory for `cfg` (a DataConfig), building it first if it is missing. Where the driver
    pinned it (`data.fingerprint`), its build when the data cache holds it (the source is not read then),
    else a build of the same key or ConfigError."""
    pinned = getattr(cfg, "fingerprint", None)  # None too in a config.yaml saved before the key existed
    built = os.path.join(os.path.expanduser(cfg.cache_dir), "corpus", f"{cfg.name}-{pinned}")
    if pinned and os.path.isfile(os.path.join(built, "corpus.json")):
        return built
    source = SOURCES[cfg.name]
    share = eval_share(cfg)
    settings = {"name": cfg.name, "seq_len": cfg.seq_len, "eval_percent": share, "source": source.fingerprint(cfg),
                "format": 3}

    def write(tmp: str) -> dict:
        splits: dict[str, list[np.ndarray]] = {"train": [], "eval": []}
        for doc_id, ids in source.documents(cfg):
            in_eval = zlib.crc32(doc_id.encode()) % 10_000 < share * 100
            splits["eval" if in_eval else "train"].append(ids)
        counts = {name: _write_rows(docs, cfg.seq_len, os.path.join(tmp, name)) for name, docs in splits.items()}
        top = max((int(ids.max()) for docs in splits.values() for ids in docs if len(ids)), default=0)
        return {"rows": counts, "max_token_id": top}

    return build_once(cfg.cache_dir, cfg.name, settings, write, pinned)


def dropped_text(dropped: dict[str, int], total: int) -> str:
    """'3 of 40 rows dropped (2 with no assistant turn, 1 empty)'."""
    why = ", ".join(f"{n} {'' if reason == 'empty' else 'with '}{reason}" for reason, n in dropped.items())
    return f"{sum(dropped.values())} of {total} rows dropped ({why})"


def without_eval(d, rows: int, needed: int) -> str:
    """The one line saying that a run of the default `data.eval_percent` trains without eval."""
    return (f"data.eval_percent (unset: {eval_share(d):g}) leaves the eval split of data={d.name} {rows} row(s), "
            f"too few for an eval step ({needed}): training without eval (set data.eval_percent to hold out more)")


def eval_rows(corpus: str) -> int:
    with open(os.path.join(corpus, "corpus.json")) as f:
        return json.load(f)["rows"]["eval"]


def check_corpus(corpus: str, cfg) -> None:
    """Raise ConfigError unless the corpus can feed the job `cfg`: the model has an embedding for every
    token id in it, and every split read from it holds at least one global batch."""
    with open(os.path.join(corpus, "corpus.json")) as f:
        info = json.load(f)
    d, batch = cfg.data, cfg.train.global_batch_size
    if info["max_token_id"] >= cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size, f"the corpus holds token id "
                          f"{info['max_token_id']} ({d.tokens_column or d.text_column!r} of data.path={d.path}): "
                          f"must be > {info['max_token_id']}")
    train_rows = info["rows"]["train"]
    if d.cache.nodes > train_rows:
        raise ConfigError("data.cache.nodes", d.cache.nodes, f"each node serves a part of the train split's "
                          f"{train_rows} rows: must be <= {train_rows}")
    for split, endpoints_key in CACHE_KEYS.items():
        rows = info["rows"][split]
        if getattr(d.cache, endpoints_key) or rows >= batch:
            continue
        if split == "eval" and d.eval_percent is None:  # the default share of small data, short of a batch: no eval
            log.warning(without_eval(d, rows, batch))
            continue
        fix = ("raise data.eval_percent" if split == "eval" else "lower data.eval_percent") + " or use more data"
        dropped = sum(info.get("dropped", {}).values())
        if dropped and info["conversations"] >= batch:  # the rows were there: dropping them is the cause
            raise ConfigError("data.path", d.path, f"{dropped_text(info['dropped'], info['conversations'])}, which "
                              f"leaves the {split} split {rows} rows, fewer than train.global_batch_size={batch}")
        if rows == 0 and split == "eval":
            raise ConfigError("data.eval_percent", d.eval_percent, f"leaves the eval split no rows: {fix}")
        raise ConfigError("train.global_batch_size", batch, f"the {split} split holds {rows} rows of "
                          f"data.seq_len={d.seq_len} (data.eval_percent={eval_share(d):g}), fewer than one "
                          f"global batch: must be <= {rows}, or {fix}")
