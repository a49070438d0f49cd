"""A cache node: an Arrow Flight server holding its part of a Parquet dataset in memory.

The node reads the dataset with `pyarrow.dataset` (column projection, optional row filter), keeps rows
`[i*N/n, (i+1)*N/n)` of the N that pass for shard `i/n`, and holds them in one contiguous record batch.
A client addresses rows by their index in the whole dataset, so a client given every node sees one
dataset:

- `list_flights` / `get_flight_info`: the schema, this node's rows and bytes, and its place in the whole
  (`app_metadata`: JSON with `offset`, `rows`, `total_rows`, `shard`, `num_shards`); its endpoint's ticket
  streams the whole shard in record batches of about `batch_bytes`.
- `do_get(ticket)`: the ticket (`encode_ticket`) asks for several steps, each a list of `[start, stop)` row
  ranges in global indices, all on this node. The answer is one stream with a record batch per step
  holding its rows in that order: a zero-copy slice when the step is one range, else gathered (`take`, in
  two threads, up to two steps ahead of the one going out). One stream for many steps keeps the connection
  busy, where a call per step leaves it idle between calls. The ticket may name the columns to send.
- `do_action`: `health` (b"ok") and `stats` (JSON).
- With `data_port` (not under TLS), the same answers (`answer`) over the data plane (`datacache.wire`), a
  plain socket whose port the FlightInfo's `app_metadata` names (`data_port`, with the `node_id` a request
  carries): what `StreamingDataset` reads.

It also speaks Kubeflow Trainer's cache protocol (`datacache.kubeflow`), so that a pod written for the
`torch-distributed-with-cache` runtime reads it: `get_flight_info` with a path of two integers `[index,
total]` answers that partition of the whole table, an endpoint per node holding part of it (this one and
its `peers`, at their advertised addresses), each with one location and an `IndexPair` ticket for that
node's part; `do_get` takes `IndexPair` tickets (rows `[start, end]` it holds, in the table's schema);
`health_port` serves HTTP `GET /ready`. A path that is not two integers is INVALID_ARGUMENT, as Kubeflow's
head answers (pyarrow adds the raising frame to the message); an empty partition is refused with "out of
range" in the message, where Kubeflow's head answers OUT_OF_RANGE, a code a pyarrow server cannot send.

A request is bounded before anything is sent: at most `MAX_TICKET_STEPS` steps and `MAX_TICKET_RANGES`
ranges a ticket, every range non-empty and on this node, no step longer than the node. A malformed
ticket, or anything else a request gets wrong, is a `FlightServerError` that says what, with no
traceback or path of the node's.

Optional token auth (clients send `authorization: Bearer <token>`; anything else is refused, compared in
constant time) and TLS.
"""

from __future__ import annotations

import ast
import collections
import hmac
import http.server
import json
import logging
import secrets
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pyarrow.parquet as pq

from datacache import kubeflow
from datacache.parquet import parquet_files
from datacache.sql import SqlError, query
from datacache.wire import WireServer
from trainjob.allocator import keep_freed_buffers

if TYPE_CHECKING:
    import pyarrow.dataset as pads

log = logging.getLogger(__name__)

MAX_READERS = 64  # a client's read-ahead threads at most, each with a connection to every node

# Threads that gather shuffled steps (Arrow's take, which lets go of the GIL), and how many steps a stream
# gathers ahead of the one it sends: the gather of the next overlaps the sending of this one.
GATHER_THREADS, GATHER_AHEAD = 2, 2

# What one ticket may ask for: steps, and [start, stop) row ranges (16 bytes each: 16 MiB of ticket).
MAX_TICKET_STEPS, MAX_TICKET_RANGES = 1 << 16, 1 << 20


class DataCacheError(RuntimeError):
    """The cache cannot serve: a bad source, an unreachable node, a refused token, mismatched nodes."""


class TokenAuth(flight.ServerMiddlewareFactory):
    """Refuses every call that does not carry `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info, headers):
        values = headers.get("authorization") or headers.get("Authorization") or []
        if not values:
            raise flight.FlightUnauthenticatedError(
                "datacache: missing or wrong token: this node was started with a token and the call carried none "
                "(send `authorization: Bearer <token>`; Kubeflow Trainer's DataCacheDataset sends none, so serve it "
                "from a node started without --token-file/--token/$TRAINJOB_CACHE_TOKEN)")
        if not any(hmac.compare_digest(v if isinstance(v, bytes) else v.encode(), self._expected) for v in values):
            raise flight.FlightUnauthenticatedError("datacache: missing or wrong token: the call's token is not this "
                                                    "node's")
        return None  # accepted; nothing more to do for this call


class ReadyServer(http.server.ThreadingHTTPServer):
    """The node's readiness over HTTP, as Kubeflow's cache answers it: `GET /ready` is 200 `ready` (the node
    holds its rows: it exists only once they are loaded); anything else 404. Serves from a thread of its own."""

    daemon_threads = True

    def __init__(self, host: str, port: int):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # the name http.server calls
                ok = self.path.split("?", 1)[0] == "/ready"
                body = b"ready" if ok else b"not found: GET /ready\n"
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # no line per probe in the node's log
                pass

        try:
            super().__init__((host.strip("[]"), port), Handler)
        except OSError as e:
            raise DataCacheError(f"--health-port {port}: cannot listen on {host}:{port} ({e.strerror})") from None
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, name="datacache-ready", daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


_COMPARE = {ast.Eq: "__eq__", ast.NotEq: "__ne__", ast.Lt: "__lt__", ast.LtE: "__le__", ast.Gt: "__gt__",
            ast.GtE: "__ge__"}


def parse_filter(text: str) -> pads.Expression:
    """A row filter such as `split == 'train' and length >= 128` or `lang in ['en', 'fr']` as a pyarrow
    expression: column names, literals, comparisons, `in`, and `and`/`or`/`not`. Nothing is evaluated."""
    import pyarrow.dataset as pads  # here, not at the top: it imports pandas, seconds of every rank's start

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
    except (SyntaxError, ValueError, KeyError, TypeError) as e:  # TypeError: `x in 5`, a literal not a list
        raise DataCacheError(f"--filter {text!r}: give comparisons of columns with literals joined by and/or, "
                             f"such as \"split == 'train' and length >= 128\" ({e})") from None


def _check_files(files: list[str]) -> None:
    """Every file's footer reads, and every file has the first one's schema (one dataset, one schema)."""
    first = None
    for path in files:
        try:
            schema = pq.read_schema(path)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataCacheError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        first = first or (path, schema)
        if not schema.equals(first[1]):
            def fields(s: pa.Schema) -> str:
                return ", ".join(f"{f.name}: {f.type}" for f in s)

            raise DataCacheError(f"{path}: its schema ({fields(schema)}) is not that of {first[0]} "
                                 f"({fields(first[1])}): the files of --source must share one")


def _check_filter(dataset: pads.Dataset, row_filter: str, expr: pads.Expression) -> None:
    """Every column the filter names is in the dataset, and the filter's literals compare with them."""
    try:
        dataset.head(1, filter=expr)
    except (pa.ArrowException, TypeError) as e:
        raise DataCacheError(f"--filter {row_filter!r}: {str(e).splitlines()[0]} (the dataset has columns "
                             f"{', '.join(dataset.schema.names)})") from None


def _damaged_file(files: list[str], error: BaseException) -> str:
    """Why the rows could not be read, naming the file: the first of `files` that does not read whole."""
    for path in files:
        try:
            pq.ParquetFile(path).read()
        except Exception as e:  # pyarrow raises several types for a damaged page
            return f"{path}: a damaged Parquet file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return f"the Parquet files cannot be read ({type(error).__name__}: {error})"


def load_shard(source: str, shard: int, num_shards: int, columns: list[str] | None = None,
               row_filter: str | None = None, sql: str | None = None) -> tuple[pa.RecordBatch, int, int]:
    """(this shard's rows as one contiguous record batch, its global row offset, the dataset's total rows): of
    the source's rows, projected to `columns` and kept by `row_filter`, or of the result of `sql` over them
    (`datacache.sql`: the table `data`). A file whose footer reads but whose pages do not is named."""
    files = parquet_files(source)
    if not files:
        raise DataCacheError(f"--source {source!r}: no Parquet files there")
    _check_files(files)
    if sql is not None and (columns or row_filter):
        raise DataCacheError("--sql: give the query alone; its SELECT and WHERE do what --columns and --filter would")
    try:
        return _read_shard(files, shard, num_shards, columns, row_filter, sql)
    except SqlError as e:  # a query that does not plan, or fails on a row as it runs
        raise DataCacheError(f"--sql {sql!r}: {e}") from None
    except (pa.ArrowException, OSError) as e:  # a page that does not decompress or decode
        raise DataCacheError(_damaged_file(files, e)) from None


def _read_shard(files: list[str], shard: int, num_shards: int, columns: list[str] | None, row_filter: str | None,
                sql: str | None) -> tuple[pa.RecordBatch, int, int]:
    if sql is not None:
        schema, total, batches = query(files, sql)
        if total == 0:
            raise SqlError("its result holds no rows")
    else:
        import pyarrow.dataset as pads

        dataset = pads.dataset(files, format="parquet")
        expr = parse_filter(row_filter) if row_filter else None
        if expr is not None:
            _check_filter(dataset, row_filter, expr)
        if columns:
            missing = [c for c in columns if c not in dataset.schema.names]
            if missing:
                raise DataCacheError(f"--columns: {', '.join(missing)} not in the dataset "
                                     f"({', '.join(dataset.schema.names)})")
        total = dataset.count_rows(filter=expr)
        batches = dataset.to_batches(columns=columns, filter=expr)
        schema = dataset.schema if not columns else pa.schema([dataset.schema.field(c) for c in columns])
    lo, hi = shard * total // num_shards, (shard + 1) * total // num_shards
    kept, seen = [], 0
    for batch in batches:
        start, stop = max(lo - seen, 0), min(hi - seen, batch.num_rows)
        if start < stop:
            kept.append(batch.slice(start, stop - start))
        seen += batch.num_rows
        if seen >= hi:
            break
    whole = pa.Table.from_batches(kept, schema=schema).combine_chunks().to_batches()
    return (whole[0] if whole else pa.RecordBatch.from_pylist([], schema=schema)), lo, total


def keep_gathered_buffers() -> None:
    """In a node's own process, before it loads: Arrow allocates from glibc's malloc, set to keep freed buffers
    (`trainjob.allocator.keep_freed_buffers`), so that each shuffled step's gather reuses a freed one's pages;
    Arrow's default allocator (mimalloc) gives them back, and every gather faulted fresh pages in (2.8 ms
    against 2.2 for 8 MiB of 2 KiB rows, on 2 cores)."""
    if keep_freed_buffers():
        pa.set_memory_pool(pa.system_memory_pool())


def _gather(rows: pa.RecordBatch, ranges: np.ndarray) -> pa.RecordBatch:
    """The rows of `ranges` ([start, stop) pairs), in order, as one record batch."""
    lengths = ranges[:, 1] - ranges[:, 0]
    return rows.take(np.repeat(ranges[:, 0] - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum()))


def encode_ticket(steps: list[np.ndarray], columns: list[str] | None = None) -> bytes:
    """A do_get ticket for `steps`, each an (n, 2) array of [start, stop) global row ranges: a JSON line
    (`columns`, number of steps), then little-endian int64s: each step's range count, then all ranges."""
    header = json.dumps({"columns": columns, "steps": len(steps)}).encode()
    counts = np.array([len(ranges) for ranges in steps], dtype="<i8")
    return b"\n".join([header, np.concatenate([counts, *(np.asarray(r, "<i8").ravel() for r in steps)]).tobytes()])


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a ticket may hold")


def _decode(ticket: bytes) -> tuple[list[np.ndarray], list[str] | None]:
    header, newline, body = ticket.partition(b"\n")
    if not newline:
        raise ValueError("no JSON header line")
    request = json.loads(header, parse_constant=_no_constant)
    if not isinstance(request, dict):
        raise ValueError("the header is not a JSON object")
    count, columns = request.get("steps"), request.get("columns")
    if type(count) is not int or not 0 <= count <= MAX_TICKET_STEPS:
        raise ValueError(f'"steps" must be an integer in [0, {MAX_TICKET_STEPS}], not {json.dumps(count)[:40]}')
    if columns is not None and not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
        raise ValueError(f'"columns" must be a list of column names or null, not {json.dumps(columns)[:40]}')
    if len(body) % 8 or len(body) < count * 8 or (len(body) // 8 - count) % 2:
        raise ValueError(f"the body is not {count} range counts and [start, stop) pairs of int64")
    values = np.frombuffer(body, dtype="<i8")
    counts, ranges = values[:count], values[count:].reshape(-1, 2)
    if len(ranges) > MAX_TICKET_RANGES:
        raise ValueError(f"{len(ranges)} row ranges; a ticket may hold at most {MAX_TICKET_RANGES}")
    if (counts < 0).any() or counts.sum() != len(ranges):
        raise ValueError(f"the steps' range counts add up to {counts.sum()}, but the ticket holds {len(ranges)} ranges")
    return (np.split(ranges, np.cumsum(counts)[:-1]) if count else []), columns


def decode_ticket(ticket: bytes) -> tuple[list[np.ndarray], list[str] | None]:
    """`encode_ticket`'s steps (views of the ticket's bytes) and columns; a `FlightServerError` saying what is
    wrong with a malformed one."""
    try:
        return _decode(ticket)
    except Exception as e:  # json and numpy raise several types on bad input; all of them are the client's
        problem = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise flight.FlightServerError(f"datacache: not a datacache ticket (datacache.server.encode_ticket): "
                                       f"{problem}") from None


def _address(flag: str, text: str) -> str:
    """`host:port`, given as that or as a Flight location (grpc://host:port), checked."""
    text = text.split("://", 1)[-1]
    host, colon, port = text.rpartition(":")
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        raise DataCacheError(f"{flag} {text!r}: give host:port, for example cache-0.cache:50051")
    return text


class CacheServer(flight.FlightServerBase):
    def __init__(self, source: str, location: str = "grpc://127.0.0.1:0", shard: int = 0, num_shards: int = 1,
                 columns: list[str] | None = None, row_filter: str | None = None, batch_bytes: int = 8 << 20,
                 token: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 advertise: str | None = None, peers: list[str] | None = None, health_port: int | None = None,
                 sql: str | None = None, data_port: int | None = None):
        if not 0 <= shard < num_shards:
            raise DataCacheError(f"--shard {shard}/{num_shards}: the shard must be in [0, {num_shards})")
        if advertise is not None:
            advertise = _address("--advertise", advertise)
        self.num_shards = num_shards
        self.set_peers(peers)
        self.rows, self.offset, self.total_rows = load_shard(source, shard, num_shards, columns, row_filter, sql)
        self.shard = shard
        self.batch_rows = max(1, batch_bytes * max(1, self.rows.num_rows) // max(1, self.rows.nbytes))
        tls = None
        if tls_cert or tls_key:
            with open(tls_cert, "rb") as c, open(tls_key, "rb") as k:
                tls = [flight.CertKeyPair(c.read(), k.read())]
        middleware = {"auth": TokenAuth(token)} if token else None
        host = location.split("://", 1)[1].rsplit(":", 1)[0]
        # Gathers of shuffled steps, made ahead of the one being sent (`_step_batches`).
        self._gathers = ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="datacache-gather")
        self.node_id = secrets.token_hex(8)  # which server a data-plane request is for (`datacache.wire`)
        # The data plane on `data_port` (0: a free one), before Flight: a port it cannot take leaves nothing
        # running. None under TLS, which it would bypass.
        self.wire = None
        if data_port is not None and not tls:
            try:
                self.wire = WireServer(host, data_port, self.node_id, token, self.answer)
            except OSError as e:
                raise DataCacheError(f"data port {data_port}: cannot listen on {host}: {e.strerror or e}") from None
        try:
            super().__init__(location, tls_certificates=tls, middleware=middleware)
        except BaseException:
            if self.wire is not None:
                self.wire.close()
            raise
        self.scheme = "grpc+tls" if tls else "grpc+tcp"
        if advertise is None:  # a wildcard bind is no address to give clients: this machine's name is
            advertise = f"{socket.gethostname() if host in ('0.0.0.0', '::', '[::]', '') else host}:{self.port}"
        self.location = f"{self.scheme}://{_address('--advertise', advertise)}"
        self.health = ReadyServer(host, health_port) if health_port is not None else None
        log.info("cache node %d/%d at %s: rows [%d, %d) of %d, %.1f MB", shard, num_shards, self.location,
                 self.offset, self.offset + self.rows.num_rows, self.total_rows, self.rows.nbytes / 1e6)

    def set_peers(self, peers: list[str] | None) -> None:
        """Every node's host:port (or Flight location) in shard order, this one's too: then this node answers a
        Kubeflow client for the whole table (None: for its own rows, the whole table only with one shard).
        Nodes bound to port 0 learn their peers once all are up."""
        if peers is not None:
            peers = [_address("--peers", p) for p in peers]
            if len(peers) != self.num_shards:
                raise DataCacheError(f"--peers: {len(peers)} addresses for {self.num_shards} shards: give every "
                                     f"node's host:port in shard order, this one's too")
        self.peers = peers

    def shutdown(self):
        if self.health is not None:
            self.health.close()
        if self.wire is not None:
            self.wire.close()  # its streams in flight cut, their clients retry
        super().shutdown()  # Flight's calls in flight finish first
        self._gathers.shutdown(wait=False)

    def stats(self) -> dict[str, Any]:
        return {"offset": self.offset, "rows": self.rows.num_rows, "total_rows": self.total_rows,
                "bytes": self.rows.nbytes, "shard": self.shard, "num_shards": self.num_shards,
                "batch_rows": self.batch_rows, "schema": self.rows.schema.to_string(show_schema_metadata=False),
                "data_port": self.wire.port if self.wire is not None else None, "node_id": self.node_id}

    def _info(self, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        stats = self.stats()
        starts = np.arange(self.offset, self.offset + self.rows.num_rows, self.batch_rows)
        stops = np.minimum(starts + self.batch_rows, self.offset + self.rows.num_rows)
        ticket = flight.Ticket(encode_ticket([np.array([[a, b]]) for a, b in zip(starts, stops, strict=True)]))
        endpoint = flight.FlightEndpoint(ticket, [self.location])
        return flight.FlightInfo(self.rows.schema, descriptor, [endpoint], self.rows.num_rows, self.rows.nbytes,
                                 ordered=True, app_metadata=json.dumps(stats).encode())

    def list_flights(self, context, criteria):
        yield self._info(flight.FlightDescriptor.for_path("dataset"))

    def get_flight_info(self, context, descriptor):
        if descriptor.descriptor_type == flight.DescriptorType.PATH and len(descriptor.path) == 2:
            return self._partition_info(descriptor)  # Kubeflow's client: partition index of total
        return self._info(descriptor)

    def holders(self) -> list[tuple[int, int, str]]:
        """(first row, row after the last, location) of every node of the table, this one's included: its
        peers' rows are where `load_shard` puts a shard of the same rows."""
        if self.peers is None:
            return [(self.offset, self.offset + self.rows.num_rows, self.location)]
        n, total = self.num_shards, self.total_rows
        return [(i * total // n, (i + 1) * total // n,
                 self.location if i == self.shard else f"{self.scheme}://{peer}") for i, peer in enumerate(self.peers)]

    def _partition_info(self, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        """Kubeflow's head's answer: partition `index` of `total` as an endpoint per node holding part of it,
        each with one location and an IndexPair ticket for that node's part."""
        texts = [p.decode(errors="replace") for p in descriptor.path]
        if not all(t.isdigit() for t in texts):
            # ValueError: Kubeflow's INVALID_ARGUMENT (pyarrow adds the raising frame to the message)
            raise ValueError(f"datacache: path {texts}: give [index, total] as two integers, as Kubeflow's "
                             f"DataCacheDataset does (FlightDescriptor.for_path(str(index), str(total)))")
        index, total = int(texts[0]), int(texts[1])
        if self.peers is None and self.num_shards > 1:
            raise flight.FlightServerError(
                f"datacache: this node holds shard {self.shard}/{self.num_shards} only and knows no peers: start "
                f"every node with --peers host:port,... (all {self.num_shards}, in shard order) to answer for the "
                f"whole table")
        part = kubeflow.partition(self.total_rows, index, total)
        if part is None:  # Kubeflow's head answers OUT_OF_RANGE, which a pyarrow server cannot send
            raise flight.FlightServerError(f"datacache: out of range: partition {index} of {total} holds no rows of "
                                           f"the table's {self.total_rows}")
        start, end = part
        endpoints = []
        for lo, hi, where in self.holders():
            a, b = max(start, lo), min(end, hi - 1)
            if a <= b:
                pair = kubeflow.encode_index_pair(a, b)
                endpoints.append(flight.FlightEndpoint(pair, [where], app_metadata=pair))
        return flight.FlightInfo(self.rows.schema, descriptor, endpoints, end - start + 1, -1, ordered=True)

    def _request(self, ticket: bytes) -> tuple[list[np.ndarray], pa.RecordBatch]:
        """The ticket's steps as local row ranges, and the columns asked for; checked before anything is sent."""
        steps, columns = decode_ticket(ticket)
        names = self.rows.schema.names
        missing = [c for c in columns or [] if c not in names]
        if missing:
            raise flight.FlightServerError(f"datacache: no column {', '.join(missing)} here (there are "
                                           f"{', '.join(names)})")
        held = (self.offset, self.offset + self.rows.num_rows)
        ranges = np.concatenate(steps) if steps else np.empty((0, 2), np.int64)
        empty = ranges[:, 0] >= ranges[:, 1]
        if empty.any():
            start, stop = ranges[np.argmax(empty)]
            raise flight.FlightServerError(f"datacache: rows [{start}, {stop}) are no rows: give [start, stop) with "
                                           f"start < stop")
        bad = (ranges[:, 0] < held[0]) | (ranges[:, 1] > held[1])
        if bad.any():
            start, stop = ranges[np.argmax(bad)]
            raise flight.FlightServerError(f"datacache: rows [{start}, {stop}) are not on this node, which holds "
                                           f"[{held[0]}, {held[1]})")
        ends = np.cumsum([len(r) for r in steps], dtype=np.int64)
        total = np.concatenate([[0], np.cumsum(ranges[:, 1] - ranges[:, 0])])
        step_rows = total[ends] - total[np.concatenate([[0], ends[:-1]])]
        if (step_rows > self.rows.num_rows).any():
            raise flight.FlightServerError(f"datacache: a step of {step_rows.max()} rows is more than this node "
                                           f"holds ({self.rows.num_rows})")
        return [r - self.offset for r in steps], self.rows.select(columns) if columns else self.rows

    def _step_batches(self, steps: list[np.ndarray], rows: pa.RecordBatch):
        """A record batch per step: a zero-copy slice for one range, else its rows gathered in order (`take`),
        up to GATHER_AHEAD steps ahead in the node's gather threads, while the steps before go out."""
        ahead: collections.deque = collections.deque()
        for ranges in steps:
            if len(ranges) == 1:
                ahead.append(rows.slice(int(ranges[0, 0]), int(ranges[0, 1] - ranges[0, 0])))
            else:
                try:
                    ahead.append(self._gathers.submit(_gather, rows, ranges))
                except RuntimeError:  # the gather threads have stopped: the node is shutting down (retried)
                    raise flight.FlightUnavailableError("datacache: the node is shutting down") from None
            while len(ahead) > GATHER_AHEAD or (ahead and not isinstance(ahead[0], Future)):
                first = ahead.popleft()
                yield first.result() if isinstance(first, Future) else first
        for first in ahead:
            yield first.result() if isinstance(first, Future) else first

    def _pair_range(self, ticket: bytes) -> tuple[int, int]:
        """(start, end) of an IndexPair ticket; FlightServerError for one that names no rows of the table."""
        start, end = kubeflow.decode_index_pair(ticket)
        if end < start:
            raise flight.FlightServerError(f"datacache: out of range: IndexPair [{start}, {end}] ends before it "
                                           "starts (give [start, end], end inclusive)")
        if start >= self.total_rows:
            raise flight.FlightServerError(f"datacache: out of range: IndexPair [{start}, {end}] starts past the "
                                           f"table's {self.total_rows} rows")
        return start, end

    def _pair_batches(self, start: int, end: int):
        """Rows [start, end] of an IndexPair that this node holds, in record batches of `batch_rows`."""
        lo, hi = max(start, self.offset) - self.offset, min(end + 1, self.offset + self.rows.num_rows) - self.offset
        for a in range(lo, hi, self.batch_rows):
            yield self.rows.slice(a, min(self.batch_rows, hi - a))

    def answer(self, ticket: bytes) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """What a datacache ticket gets, on either plane (`do_get`, `datacache.wire`): the schema of the columns
        asked for and a record batch per step; the request is checked before anything is sent."""
        try:
            steps, rows = self._request(ticket)
        except flight.FlightError:
            raise
        except Exception:  # a bug of ours: the client hears what kind, the node's log has the traceback
            log.exception("do_get")
            raise flight.FlightServerError("datacache: the node failed on this ticket; its log says why") from None
        return rows.schema, self._guarded(self._step_batches(steps, rows))

    def do_get(self, context, ticket):
        if kubeflow.is_index_pair(ticket.ticket):  # Kubeflow's client, or StreamingDataset reading a Kubeflow cache
            pair = self._pair_range(ticket.ticket)
            return flight.GeneratorStream(self.rows.schema, self._guarded(self._pair_batches(*pair)))
        return flight.GeneratorStream(*self.answer(ticket.ticket))

    @staticmethod
    def _guarded(batches):
        """The batches of a stream; a failure while sending reaches the client as one line, not the node's
        traceback and file paths (those go to the node's log)."""
        try:
            yield from batches
        except flight.FlightError:
            raise
        except Exception:
            log.exception("do_get while sending")
            raise flight.FlightServerError("datacache: the node failed while sending; its log says why") from None

    def do_action(self, context, action):
        if action.type == "health":
            yield flight.Result(b"ok")
        elif action.type == "stats":
            yield flight.Result(json.dumps(self.stats()).encode())
        else:
            raise flight.FlightServerError(f"datacache: unknown action {action.type!r}; try health or stats")

    def list_actions(self, context):
        return [("health", "b'ok' while the node serves"), ("stats", "rows, bytes, shard and schema, as JSON")]
