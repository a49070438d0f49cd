"""Parquet files and their columns as numpy arrays: what the cache node and the trainer read without torch
(a cache node never imports it).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def parquet_files(path: str | list[str] | tuple[str, ...]) -> list[str]:
    """The Parquet files named by `path`: a file, a directory (searched recursively) or a glob, or a list of
    those (in the order given, each one's files sorted). A file or directory that exists is taken as named,
    even with glob characters (`[`) in its name."""
    if not isinstance(path, str):
        return [f for p in path for f in parquet_files(p)]
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(glob.escape(path), "**", "*.parquet"), recursive=True))
    if os.path.isfile(path):
        return [path]
    return sorted(glob.glob(path))


def token_matrix(column: pa.ChunkedArray | pa.Array, what: str) -> np.ndarray:
    """A fixed-size list column as a 2-D array (rows, row_len), zero-copy when it is one chunk."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not pa.types.is_fixed_size_list(column.type):
        raise TypeError(f"{what} is {column.type}, not a fixed-size list of token ids")
    values = column.values.to_numpy(zero_copy_only=False)
    return values.reshape(len(column), column.type.list_size)


def column_array(column: pa.ChunkedArray | pa.Array, what: str) -> np.ndarray:
    """A fixed-size list column as a 2-D array, a primitive (number or bool) column as 1-D; zero-copy when it
    can be. Anything else (strings, variable-length lists) has no fixed shape: a TypeError naming `what`."""
    kind = column.type
    if pa.types.is_fixed_size_list(kind):
        return token_matrix(column, what)
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        raise TypeError(f"{what} is {kind}: give fixed-size lists or number columns, which make tensors")
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column.to_numpy(zero_copy_only=False)


def read_table(files: str | list[str] | tuple[str, ...], columns: list[str] | None = None) -> pa.Table:
    """`columns` (None: all) of one Parquet file or several, rows in file order. Read file by file, and joined
    when the files' schemas are the same: `pq.read_table` goes through `pyarrow.dataset`, whose import (pandas
    with it) costs a rank ~0.35 s of its start; files whose schemas differ (int32 and int64, a column one file
    lacks) still go through it, which casts them to the first file's schema as before."""
    files = [files] if isinstance(files, str) else list(files)
    tables = [pq.ParquetFile(f).read(columns=columns) for f in files]
    whole = columns is None or set(columns) <= set(tables[0].schema.names)  # else pyarrow names what is missing
    if whole and all(t.schema.equals(tables[0].schema) for t in tables[1:]):
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    return pq.read_table(files, columns=columns)


def read_columns(path: str | list[str] | tuple[str, ...], columns: list[str]) -> dict[str, np.ndarray]:
    """Each of `columns` of every file at `path` (see `parquet_files`) as one array, rows in file order."""
    files = parquet_files(path)
    if not files:
        raise FileNotFoundError(f"no Parquet files at {path!r}")
    names = pq.ParquetFile(files[0]).schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{files[0]} has no column {', '.join(map(repr, missing))} (it has {', '.join(names)})")
    table = read_table(files, list(columns))
    arrays = {c: column_array(table.column(c), f"column {c!r} in {path!r}") for c in columns}
    del table
    return released(arrays)


def read_token_rows(path: str, column: str = "tokens") -> np.ndarray:
    """All rows of a fixed-length token-list column, as a 2-D array (rows, row_len)."""
    files = parquet_files(path)
    if not files:
        raise FileNotFoundError(f"no Parquet files at {path!r}")
    table = read_table(files, [column])
    rows = token_matrix(table.column(column), f"column {column!r} in {path!r}")
    del table
    return released(rows)


def released(arrays):
    """`arrays`, once pyarrow's memory pool has given back to the system the pages that reading freed: its
    allocator (mimalloc) keeps them resident otherwise, several times the data (the decoded pages, the chunks
    combined: ~0.35 GiB for a 62 MB column measured), in every process that reads its rows."""
    pa.default_memory_pool().release_unused()
    return arrays
