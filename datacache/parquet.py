"""Parquet files and their fixed-length token columns as numpy arrays: what the cache node and the trainer
read without torch (a cache node never imports it).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def parquet_files(path: str) -> list[str]:
    """The Parquet files named by `path`: a file, a directory (searched recursively) or a glob. A file or
    directory that exists is taken as named, even with glob characters (`[`) in its name."""
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


def read_token_rows(path: str, column: str = "tokens") -> np.ndarray:
    """All rows of a fixed-length token-list column, as a 2-D array (rows, row_len)."""
    files = parquet_files(path)
    if not files:
        raise FileNotFoundError(f"no Parquet files at {path!r}")
    table = pq.read_table(files if len(files) > 1 else files[0], columns=[column])
    return token_matrix(table.column(column), f"column {column!r} in {path!r}")
