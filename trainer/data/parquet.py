"""`data=parquet`: a user's Parquet files (`data.path`: a file, a directory or a glob) with a text column
(`data.text_column`, tokenized byte by byte) or a column of token-id lists (`data.tokens_column`). A file that is
not Parquet, a column missing or of the wrong type, a page that cannot be decoded or a token id that does not fit
the rows is a ConfigError naming the key and the file."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from datacache.parquet import parquet_files
from trainer.data import sources, tokenizer
from trainer.errors import ConfigError

MAX_TOKEN_ID = np.iinfo(np.uint16).max  # rows store uint16 ids


def fingerprint(cfg) -> dict:
    """What the corpus is built from: the files (path, size, time; a URL's objects: URL, size, version) and the
    column read."""
    files = parquet_files(sources.local(cfg))
    if not files:
        raise ConfigError("data.path", cfg.path, "no Parquet files there: give a .parquet file, a directory "
                          "holding some, or a glob")
    return {"files": [sources.identity(f) for f in files],
            "text_column": cfg.text_column, "tokens_column": cfg.tokens_column}


def documents(cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(document id, token ids ending in EOS) for every non-null row of the column, file by file."""
    key, column = ("data.tokens_column", cfg.tokens_column) if cfg.tokens_column else ("data.text_column",
                                                                                        cfg.text_column)
    files = parquet_files(sources.local(cfg))
    # Document ids relative to the files' common folder: the same files elsewhere split the same way
    # (an absolute path made the train/eval split depend on where the data happened to lie).
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in files]) if files else ""
    for path in files:
        doc = os.path.relpath(os.path.abspath(path), root)
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise ConfigError("data.path", cfg.path, f"{path} is not a readable Parquet file ({e})") from None
        if column not in pf.schema_arrow.names:
            raise ConfigError(key, column, f"{path} has no such column; it has {', '.join(pf.schema_arrow.names)}")
        _check_column_type(key, column, pf.schema_arrow.field(column).type, path)
        row = 0
        for batch in _batches(pf, column, cfg.path, path):
            if cfg.tokens_column:
                _check_token_ids(batch.column(0), column, path)
            for value in batch.column(0).to_pylist():
                if value is not None:
                    ids = (np.append(np.asarray(value, dtype=np.uint16), tokenizer.EOS) if cfg.tokens_column
                           else tokenizer.encode(value))
                    yield f"{doc}:{row}", ids
                row += 1


def _batches(pf: pq.ParquetFile, column: str, source: str, path: str) -> Iterator[pa.RecordBatch]:
    """The column's record batches; a page that cannot be decoded (corrupt, cut short) is a ConfigError
    naming the file."""
    batches = pf.iter_batches(columns=[column])
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as e:
            raise ConfigError("data.path", source, f"{path} cannot be read: {str(e).splitlines()[0]}") from None
        yield batch


def _check_column_type(key: str, column: str, kind: pa.DataType, path: str) -> None:
    if key == "data.text_column":
        ok, wanted = pa.types.is_string(kind) or pa.types.is_large_string(kind), "text (string)"
    else:
        ok = ((pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))
              and pa.types.is_integer(kind.value_type))
        wanted = "lists of integer token ids"
    if not ok:
        other = "data.tokens_column for token ids" if key == "data.text_column" else "data.text_column for text"
        raise ConfigError(key, column, f"{path} holds {kind} there, not {wanted}: name another column, or "
                          f"use {other}")


def _check_token_ids(lists: pa.Array, column: str, path: str) -> None:
    flat = pc.list_flatten(lists)
    if flat.null_count:
        raise ConfigError("data.tokens_column", column, f"{path} holds a null token id: every id must be a number")
    ids = pc.min_max(flat)
    low, high = ids["min"].as_py(), ids["max"].as_py()
    if low is not None and (low < 0 or high > MAX_TOKEN_ID):
        raise ConfigError("data.tokens_column", column, f"{path} holds token id {low if low < 0 else high}: "
                          f"ids must be in [0, {MAX_TOKEN_ID}]")
