"""Node-side SQL (`python -m datacache serve --sql ...`, DataFusion): the node holds the query's result, in
the source's row order, so that nodes of a cluster hold disjoint shards of the same rows; a query that
cannot run is refused before the node serves. Real nodes on loopback and real processes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datacache import CacheServer, DataCacheError, StreamingDataset
from tests.conftest import REPO, examples


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Three files of 1,000 rows in row groups of 128: `id`, `quality` (id % 10 / 10) and 4 tokens (= id)."""
    root = tmp_path_factory.mktemp("sql")
    for f in range(3):
        ids = np.arange(f * 1000, (f + 1) * 1000, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "quality": (ids % 10) / 10,
                                 "tokens": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4)), 4)}),
                       root / f"part-{f}.parquet", row_group_size=128)
    return str(root)


def _held(servers) -> list[int]:
    return [i for s in servers for i in s.rows.column("id").to_pylist()] if "id" in servers[0].rows.schema.names \
        else [i for s in servers for i in s.rows.column("tokens").flatten().to_pylist()[::4]]


@settings(max_examples=examples(6), deadline=None)
@given(threshold=st.sampled_from([0.0, 0.25, 0.5, 0.85]), shards=st.integers(1, 3))
def test_nodes_hold_the_rows_of_the_query_in_source_order_as_disjoint_shards(source, threshold, shards):
    sql = f"SELECT tokens FROM data WHERE quality > {threshold}"
    servers = [CacheServer(source, shard=i, num_shards=shards, sql=sql) for i in range(shards)]
    try:
        assert servers[0].rows.schema.names == ["tokens"]  # the projection ran on the node
        expected = [i for i in range(3000) if (i % 10) / 10 > threshold]
        assert _held(servers) == expected
        assert {s.total_rows for s in servers} == {len(expected)}
    finally:
        for s in servers:
            s.shutdown()


@pytest.mark.timeout(60)
def test_a_client_streams_a_query_result_exactly_once(source):
    servers = [CacheServer(source, shard=i, num_shards=2, sql="SELECT id, tokens FROM data WHERE quality >= 0.5")
               for i in range(2)]
    for s in servers:
        threading.Thread(target=s.serve, daemon=True).start()
    try:
        ds = StreamingDataset([s.location for s in servers], columns=["id"], batch_size=50, seed=2)
        ids = np.concatenate([b["id"].numpy() for b in ds])
        assert sorted(ids.tolist()) == [i for i in range(3000) if i % 10 >= 5]
    finally:
        for s in servers:
            s.shutdown()


def test_a_query_that_cannot_run_is_refused_in_one_line(source):
    with pytest.raises(DataCacheError, match=r"--sql 'SELECT nope FROM data': Schema error: No field named nope"):
        CacheServer(source, sql="SELECT nope FROM data")
    with pytest.raises(DataCacheError, match="--sql: give the query alone"):
        CacheServer(source, sql="SELECT id FROM data", row_filter="id > 3")
    run = subprocess.run([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", "0", "--sql",
                          "SELEC id FROM data"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == ["error: --sql 'SELEC id FROM data': SQL error: ParserError(\"Expected: "
                                               "an SQL statement, found: SELEC at Line: 1, Column: 1\")"]


@pytest.mark.parametrize(("sql", "message"), [
    ("SELECT id FROM data WHERE nope > 1", "Schema error: No field named nope"),
    ("", "No SQL statements were provided"),
    ("SELECT id FROM data; SELECT 1", "only supports a single SQL statement"),
    ("DROP TABLE data", "a node holds the result of a query: give one statement starting with SELECT, WITH, VALUES"),
    ("SELECT CAST(CAST(id AS VARCHAR) || 'x' AS INT) AS v FROM data", "Cast error"),
    ("SELECT id / 0 AS z FROM data", "Divide by zero"),
    ("SELECT id FROM data WHERE id > 99999", "its result holds no rows"),
])
def test_a_query_that_fails_as_it_plans_or_runs_is_one_line_naming_it(source, sql, message):
    with pytest.raises(DataCacheError, match=f"^--sql {re.escape(repr(sql))}: .*{re.escape(message)}") as e:
        CacheServer(source, sql=sql)
    assert "\n" not in str(e.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sql", [None, "SELECT id FROM data"])
def test_a_parquet_file_with_damaged_pages_is_named_in_one_line(source, tmp_path, sql):
    for name in ("part-0.parquet", "part-1.parquet"):
        shutil.copy(f"{source}/{name}", tmp_path / name)
    damaged = tmp_path / "part-1.parquet"
    data = bytearray(damaged.read_bytes())
    data[100:2100] = bytes(range(256)) * 7 + bytes(208)  # the first pages; the footer still reads
    damaged.write_bytes(bytes(data))
    run = subprocess.run([sys.executable, "-m", "datacache", "serve", "--source", str(tmp_path), "--port", "0",
                          *(["--sql", sql] if sql else [])], cwd=REPO, capture_output=True, text=True, timeout=90)
    assert run.returncode == 2 and run.stdout == "", run.stderr[-2000:]
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"error: {damaged}: a damaged Parquet file (") and "Traceback" not in run.stderr
