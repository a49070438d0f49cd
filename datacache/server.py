"""A cache node: an Arrow Flight server holding its part of a Parquet dataset in memory.

The node reads the dataset with `pyarrow.dataset` (column projection, optional row filter), keeps rows
`[i*N/n, (i+1)*N/n)` of the N that pass for shard `i/n`, and holds them as record batches of about
`batch_bytes` each. A client addresses rows by their index in the whole dataset, so a client given every
node sees one dataset:

- `list_flights` / `get_flight_info`: the schema, this node's rows and bytes, and its place in the whole
  (`app_metadata`: JSON with `offset`, `rows`, `total_rows`, `shard`, `num_shards`).
- `do_get(ticket)`: the ticket is JSON `{"ranges": [[start, stop], ...]}` in global row indices (all on
  this node); the answer is one record batch holding those rows in that order (slices of the held
  batches, copied only when a request spans several).
- `do_action`: `health` (b"ok") and `stats` (JSON).

Optional token auth (clients send `authorization: Bearer <token>`; anything else is refused) and TLS.
"""

from __future__ import annotations

import ast
import bisect
import json
import logging
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.flight as flight
import pyarrow.parquet as pq

from datacache.local import parquet_files

log = logging.getLogger(__name__)


class DataCacheError(RuntimeError):
    """The cache cannot serve: a bad source, an unreachable node, a refused token, mismatched nodes."""


class TokenAuth(flight.ServerMiddlewareFactory):
    """Refuses every call that does not carry `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"

    def start_call(self, info, headers):
        values = headers.get("authorization") or headers.get("Authorization") or []
        if self._expected not in [v.decode() if isinstance(v, bytes) else v for v in values]:
            raise flight.FlightUnauthenticatedError("datacache: missing or wrong token")
        return None  # accepted; nothing more to do for this call


_COMPARE = {ast.Eq: "__eq__", ast.NotEq: "__ne__", ast.Lt: "__lt__", ast.LtE: "__le__", ast.Gt: "__gt__",
            ast.GtE: "__ge__"}


def parse_filter(text: str) -> pads.Expression:
    """A row filter such as `split == 'train' and length >= 128` or `lang in ['en', 'fr']` as a pyarrow
    expression: column names, literals, comparisons, `in`, and `and`/`or`/`not`. Nothing is evaluated."""

    def build(node):
        if isinstance(node, ast.BoolOp):
            parts = [build(v) for v in node.values]
            out = parts[0]
            for p in parts[1:]:
                out = (out & p) if isinstance(node.op, ast.And) else (out | p)
            return out
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ~build(node.operand)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.left, ast.Name):
            column, op, right = pads.field(node.left.id), node.ops[0], ast.literal_eval(node.comparators[0])
            if isinstance(op, ast.In | ast.NotIn):
                test = column.isin(list(right))
                return test if isinstance(op, ast.In) else ~test
            return getattr(column, _COMPARE[type(op)])(right)
        raise ValueError(f"unsupported: {ast.unparse(node)}")

    try:
        return build(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, KeyError) as e:
        raise DataCacheError(f"--filter {text!r}: give comparisons of columns with literals joined by and/or, "
                             f"such as \"split == 'train' and length >= 128\" ({e})") from None


def _check_files(files: list[str]) -> None:
    for path in files:
        try:
            pq.ParquetFile(path).metadata  # noqa: B018 - reading the footer is the check
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataCacheError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def load_shard(source: str, shard: int, num_shards: int, columns: list[str] | None = None,
               row_filter: str | None = None, batch_bytes: int = 8 << 20) -> tuple[pa.Table, int, int]:
    """(this shard's rows as a table of record batches, its global row offset, the dataset's total rows)."""
    files = parquet_files(source)
    if not files:
        raise DataCacheError(f"--source {source!r}: no Parquet files there")
    _check_files(files)
    dataset = pads.dataset(files, format="parquet")
    expr = parse_filter(row_filter) if row_filter else None
    if columns:
        missing = [c for c in columns if c not in dataset.schema.names]
        if missing:
            raise DataCacheError(f"--columns: {', '.join(missing)} not in the dataset "
                                 f"({', '.join(dataset.schema.names)})")
    total = dataset.count_rows(filter=expr)
    lo, hi = shard * total // num_shards, (shard + 1) * total // num_shards
    kept, seen = [], 0
    for batch in dataset.to_batches(columns=columns, filter=expr):
        start, stop = max(lo - seen, 0), min(hi - seen, batch.num_rows)
        if start < stop:
            kept.append(batch.slice(start, stop - start))
        seen += batch.num_rows
        if seen >= hi:
            break
    schema = dataset.schema if not columns else pa.schema([dataset.schema.field(c) for c in columns])
    table = pa.Table.from_batches(kept, schema=schema).combine_chunks()
    row_bytes = max(1, table.nbytes // max(1, table.num_rows))
    table = pa.Table.from_batches(table.to_batches(max_chunksize=max(1, batch_bytes // row_bytes)), schema=schema)
    return table, lo, total


class CacheServer(flight.FlightServerBase):
    def __init__(self, source: str, location: str = "grpc://127.0.0.1:0", shard: int = 0, num_shards: int = 1,
                 columns: list[str] | None = None, row_filter: str | None = None, batch_bytes: int = 8 << 20,
                 token: str | None = None, tls_cert: str | None = None, tls_key: str | None = None):
        if not 0 <= shard < num_shards:
            raise DataCacheError(f"--shard {shard}/{num_shards}: the shard must be in [0, {num_shards})")
        self.table, self.offset, self.total_rows = load_shard(source, shard, num_shards, columns, row_filter,
                                                              batch_bytes)
        self.shard, self.num_shards = shard, num_shards
        self._batches = self.table.to_batches()
        self._starts = []
        n = 0
        for b in self._batches:
            self._starts.append(n)
            n += b.num_rows
        tls = None
        if tls_cert or tls_key:
            with open(tls_cert, "rb") as c, open(tls_key, "rb") as k:
                tls = [flight.CertKeyPair(c.read(), k.read())]
        middleware = {"auth": TokenAuth(token)} if token else None
        super().__init__(location, tls_certificates=tls, middleware=middleware)
        scheme = "grpc+tls" if tls else "grpc+tcp"
        host = location.split("://", 1)[1].rsplit(":", 1)[0]
        self.location = f"{scheme}://{host}:{self.port}"
        log.info("cache node %d/%d at %s: rows [%d, %d) of %d, %.1f MB in %d batches", shard, num_shards,
                 self.location, self.offset, self.offset + self.table.num_rows, self.total_rows,
                 self.table.nbytes / 1e6, len(self._batches))

    def stats(self) -> dict[str, Any]:
        return {"offset": self.offset, "rows": self.table.num_rows, "total_rows": self.total_rows,
                "bytes": self.table.nbytes, "shard": self.shard, "num_shards": self.num_shards,
                "batches": len(self._batches), "schema": self.table.schema.to_string(show_schema_metadata=False)}

    def _info(self, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        stats = self.stats()
        ticket = flight.Ticket(json.dumps({"ranges": [[self.offset, self.offset + self.table.num_rows]]}).encode())
        endpoint = flight.FlightEndpoint(ticket, [self.location])
        return flight.FlightInfo(self.table.schema, descriptor, [endpoint], self.table.num_rows, self.table.nbytes,
                                 ordered=True, app_metadata=json.dumps(stats).encode())

    def list_flights(self, context, criteria):
        yield self._info(flight.FlightDescriptor.for_path("dataset"))

    def get_flight_info(self, context, descriptor):
        return self._info(descriptor)

    def _slices(self, start: int, stop: int):
        """Zero-copy slices of the held batches covering local rows [start, stop)."""
        i = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            b, b0 = self._batches[i], self._starts[i]
            take = min(stop, b0 + b.num_rows) - start
            yield b.slice(start - b0, take)
            start += take
            i += 1

    def do_get(self, context, ticket):
        try:
            ranges = json.loads(ticket.ticket)["ranges"]
        except (ValueError, KeyError, TypeError):
            raise flight.FlightServerError("datacache: a ticket is JSON {\"ranges\": [[start, stop], ...]}") from None
        pieces = []
        for start, stop in ranges:
            lo, hi = start - self.offset, stop - self.offset
            if not 0 <= lo <= hi <= self.table.num_rows:
                raise flight.FlightServerError(
                    f"datacache: rows [{start}, {stop}) are not on this node, which holds "
                    f"[{self.offset}, {self.offset + self.table.num_rows})")
            pieces.extend(self._slices(lo, hi))
        if not pieces:
            batch = pa.RecordBatch.from_pylist([], schema=self.table.schema)
        elif len(pieces) == 1:
            batch = pieces[0]
        else:
            batch = pa.concat_batches(pieces)
        return flight.RecordBatchStream(pa.Table.from_batches([batch], schema=self.table.schema))

    def do_action(self, context, action):
        if action.type == "health":
            yield flight.Result(b"ok")
        elif action.type == "stats":
            yield flight.Result(json.dumps(self.stats()).encode())
        else:
            raise flight.FlightServerError(f"datacache: unknown action {action.type!r}; try health or stats")

    def list_actions(self, context):
        return [("health", "b'ok' while the node serves"), ("stats", "rows, bytes, shard and schema, as JSON")]
