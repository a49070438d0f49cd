"""`datacache.parquet.read_table`: files read one by one and joined, and files whose schemas differ (an int32
and an int64 column, a column one file lacks) read as `pq.read_table` reads them, cast to the first file's."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datacache.parquet import read_columns, read_table


def test_files_of_one_schema_are_joined_in_order(tmp_path):
    for i in range(3):
        pq.write_table(pa.table({"id": np.arange(i * 4, i * 4 + 4), "x": np.full(4, i, np.int32)}),
                       tmp_path / f"part-{i}.parquet")
    got = read_columns(str(tmp_path), ["id", "x"])
    assert got["id"].tolist() == list(range(12)) and got["x"].tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_files_whose_schemas_differ_are_cast_to_the_first_files(tmp_path):
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int32()), "w": [0.5, 1.5]}), first)
    pq.write_table(pa.table({"id": pa.array([3], pa.int64())}), second)
    table = read_table([str(first), str(second)], ["id", "w"])
    assert table.schema.field("id").type == pa.int32() and table.column("id").to_pylist() == [1, 2, 3]
    assert table.column("w").to_pylist() == [0.5, 1.5, None]


def test_a_column_the_file_lacks_is_named(tmp_path):
    pq.write_table(pa.table({"id": [1]}), tmp_path / "a.parquet")
    with pytest.raises(Exception, match="nope"):
        read_table(str(tmp_path / "a.parquet"), ["nope"])
