"""Node-side SQL (`python -m datacache serve --sql ...`) with DataFusion, as Kubeflow's cache workers query
their table: the Parquet source is the table `data`, and the query's result is what the node holds.

The source is read in file order into one in-memory partition and queried there, so that the result's row
order is the same on every node of a cluster (DataFusion scans files and row groups in parallel, in no fixed
order, when it reads them itself): each node then keeps its shard of the same rows. Filtering and projection
keep that order; a query that wants another says so with ORDER BY.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

TABLE = "data"
QUERIES = ("SELECT", "WITH", "VALUES")  # what a statement that returns rows starts with


class SqlError(ValueError):
    """The query cannot run over the source: DataFusion's own words."""


def query(files: list[str], sql: str) -> tuple[pa.Schema, int, Iterator[pa.RecordBatch]]:
    """(the result's schema, its rows, its record batches in order) of `sql` over `files` as table `data`."""
    import pyarrow.dataset as pads
    from datafusion import SessionConfig, SessionContext  # only a node given --sql needs DataFusion

    ctx = SessionContext(SessionConfig().with_target_partitions(1).with_repartition_file_scans(False))
    source = pads.dataset(files, format="parquet")
    batches = list(source.to_batches()) or [pa.RecordBatch.from_pylist([], schema=source.schema)]
    ctx.register_record_batches(TABLE, [batches])
    try:
        frame = ctx.sql(sql)
        schema, rows = frame.schema(), frame.count()
    except Exception as e:  # DataFusion raises ValueError and Exception with its message for any planning error
        raise SqlError(" ".join(str(e).split())) from None
    if sql.replace("(", " ").split()[0].upper() not in QUERIES:  # DDL (on this session's own copy): no rows
        raise SqlError(f"a node holds the result of a query: give one statement starting with {', '.join(QUERIES)}")

    def stream() -> Iterator[pa.RecordBatch]:
        try:
            for batch in frame.execute_stream():
                yield batch.to_pyarrow()
        except Exception as e:  # an error of a row, found as the query runs: a cast that fails, a division by 0
            raise SqlError(" ".join(str(e).split())) from None

    return schema, rows, stream()
