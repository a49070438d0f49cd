"""Corpus preparation: real text becomes fixed-length rows, split by document, cached and rebuilt on change."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from datacache.local import read_token_rows
from trainer.data import tokenizer
from trainer.data.corpus import prepare
from trainer.errors import ConfigError


def _cfg(tmp_path, **kw):
    base = {"name": "parquet", "path": None, "text_column": "text", "tokens_column": None, "seq_len": 8,
            "eval_percent": 50.0, "cache_dir": str(tmp_path / "cache") if tmp_path else None, "shuffle": True,
            "num_workers": 0}
    return OmegaConf.create({**base, **kw})


def _stream(rows: np.ndarray) -> np.ndarray:
    """The token stream that overlapping rows were cut from."""
    return np.concatenate([rows[0], rows[1:, 1:].reshape(-1)]) if len(rows) else rows.reshape(-1)


def test_stdlib_corpus_is_python_source_in_rows_of_seq_len_plus_one(cache_dir):
    cfg = _cfg(None, name="stdlib", seq_len=64, eval_percent=2.0, cache_dir=cache_dir)
    root = prepare(cfg)
    assert prepare(cfg) == root  # cached
    train, held_out = read_token_rows(os.path.join(root, "train")), read_token_rows(os.path.join(root, "eval"))
    assert train.shape[1] == held_out.shape[1] == 65
    assert len(train) > 100_000 and 0.005 < len(held_out) / len(train) < 0.05
    assert np.array_equal(train[0, -1:], train[1, :1])  # consecutive rows overlap by the one shifted token
    text = tokenizer.decode(_stream(train[:3]))
    assert "import" in text or "def " in text or '"""' in text


def test_parquet_text_column_split_by_document(tmp_path):
    docs = [f"document {i} " * 10 for i in range(40)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "a.parquet")
    root = prepare(_cfg(tmp_path, path=str(tmp_path / "a.parquet")))
    rows = {s: read_token_rows(os.path.join(root, s)) for s in ("train", "eval")}
    total = sum(len(tokenizer.encode(d)) for d in docs)
    assert sum(len(r) * 8 for r in rows.values()) == pytest.approx(total, abs=16)
    eval_text, train_text = tokenizer.decode(_stream(rows["eval"])), tokenizer.decode(_stream(rows["train"]))
    eval_docs = {d for d in range(40) if f"document {d} document" in eval_text}
    assert eval_docs and not any(f"document {d} document" in train_text for d in eval_docs)


def test_parquet_token_column_and_rebuild_on_change(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"ids": [list(range(20)), list(range(30, 60))]}), path)
    cfg = _cfg(tmp_path, path=str(path), text_column=None, tokens_column="ids", eval_percent=1.0)
    first = prepare(cfg)
    rows = read_token_rows(os.path.join(first, "train"))
    assert rows[0].tolist() == list(range(9)) and tokenizer.EOS in rows.reshape(-1)
    pq.write_table(pa.table({"ids": [list(range(50))]}), path)
    assert prepare(cfg) != first


def test_missing_column_is_a_clear_error(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match="data.text_column='text': .*a.parquet has no such column; it has body"):
        prepare(_cfg(tmp_path, path=str(tmp_path / "a.parquet")))
