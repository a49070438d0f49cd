"""`StreamingDataset`: this rank's batches of a dataset held by cache nodes (`datacache.server`).

Given every node's endpoint, the client sees one dataset: each node says which global rows it holds,
and all must share one schema and cover the rows without gaps. Each step's rows (by `BatchPlan`: the
same order, sharding, epochs and resumption as `LocalDataset`) are asked of the nodes that hold them as
runs of neighbouring rows. One `iter()` is one epoch (as for any IterableDataset: a `for` loop over it
ends); `loop=True` iterates endlessly, epoch after epoch, as a training loop counting steps wants.

Nothing connects until the dataset is iterated (or its `plan`/`schema` is read, or `describe()` called):
the process that iterates it, a DataLoader worker say, asks the nodes what they hold and opens its own
connections. gRPC does not survive `fork`, so a worker forked from a process that had already connected
is refused with an error saying so; forked workers of a parent that never iterated the dataset work.

Reading ahead: `readers` threads (default 2), each over its own connection to every node, keep up to
`prefetch` steps asked for and not yet consumed. A thread takes the next window of steps, as many as
there is room for (at least half the room, so calls are few: a call costs about a millisecond before its
first batch and a gRPC stream starts slowly; the default room of 32 steps makes calls of 16 steps or
more), asks each node for its part of them in one call, all nodes sending at once, and reads every
call to its end; the consumer takes the windows in plan order, and a reader with steps still to read
leaves free room to one that waits, so the two alternate. Two threads over two connections deliver
more than one on the same cores. A call goes over the node's data plane (`datacache.wire`: the steps
as an Arrow IPC stream over a plain socket, received into one buffer a batch, as a raw socket's reader
would) where the node has one and this client can connect to it, else it is Flight's `do_get`, where each
batch costs a copy more (gRPC hands a message over in slices, which Arrow joins into one buffer). A node so sends
only what is wanted and each step once, never waits on a slow consumer, and holds no stream that nobody
reads: it goes idle when its clients do. `prefetch=0`: no thread, a call per step, made when the step
is wanted. A batch that one node answers in one piece becomes a torch tensor without a copy, in a buffer
the process reuses (`trainjob.allocator`).

Every step is checked as it arrives: its row count, column names and types; a node that answers
otherwise is an error naming it. A node that cannot be reached, or fails mid-stream, is retried
`retries` times with exponential backoff (its call resumes at the first step it had not delivered); then
the error names the endpoint. A call's `timeout` is its deadline: a call that is delivering when it
passes goes on in a new call, not counted as a failure. A wrong or missing token (`token=`, else
$TRAINJOB_CACHE_TOKEN) is refused at once. The consumer waits for a batch at most `patience` seconds
(what the retries can take), then raises: an epoch ends, or fails with an error, whatever happens to
the connection.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import socket
import threading
import time
import urllib.parse
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import torch

from datacache import kubeflow
from datacache.order import BatchPlan
from datacache.parquet import column_array
from datacache.planned import PlannedDataset, plan_arguments
from datacache.server import MAX_READERS, DataCacheError, encode_ticket
from datacache.wire import Unreachable, WireReader
from trainjob.allocator import chosen, keep_freed_buffers
from trainjob.env import CACHE_TOKEN_ENV

log = logging.getLogger(__name__)

# A call carries up to this many steps, or about this many row ranges (16 bytes each in its ticket).
SPAN_STEPS, SPAN_RUNS = 1024, 65536

RETRYABLE = (flight.FlightUnavailableError, flight.FlightTimedOutError, flight.FlightInternalError,
             flight.FlightCancelledError, ConnectionError, OSError)

# Arrow's buffers are read-only and torch warns of that in every tensor made over them; nothing here writes
# them. One filter for this module's calls: warnings.catch_warnings is not thread-safe, and readers convert
# batches in threads.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=__name__)

FORKED = ("StreamingDataset: this process was forked from one that had already connected to cache nodes, and "
          "gRPC does not survive fork: iterate the dataset only in the DataLoader's workers (not in the parent "
          "before they start), or give the DataLoader multiprocessing_context='forkserver' (or 'spawn')")

_grpc_pid: int | None = None  # the process that opened this module's first Flight client (copied by fork)


def _flight_client(endpoint: str, tls_root: bytes | None) -> flight.FlightClient:
    global _grpc_pid
    if _grpc_pid not in (None, os.getpid()):
        raise DataCacheError(FORKED)
    _grpc_pid = os.getpid()
    return flight.FlightClient(endpoint, tls_root_certs=tls_root)


def _server_reason(error: flight.FlightServerError) -> str:
    """The node's own words from a refusal, without gRPC's framing (\"gRPC client debug context: ...\")."""
    text = str(error).split(". gRPC client debug context", 1)[0].split(". Detail:", 1)[0].strip()
    return text.removeprefix("datacache: ")


def _to_numpy(column: pa.Array) -> np.ndarray:
    """A fixed-size list column as a 2-D array, a primitive column as 1-D; zero-copy when possible."""
    return column_array(column, "a cached column")


def _to_tensor(column: pa.Array | np.ndarray) -> torch.Tensor:
    values = _to_numpy(column) if isinstance(column, pa.Array) else column
    return torch.from_numpy(values)


def _has_dictionary(kind: pa.DataType) -> bool:
    """Whether a column of this type holds dictionary-encoded values, at any depth (an extension type's storage
    too)."""
    if isinstance(kind, pa.ExtensionType):
        return _has_dictionary(kind.storage_type)
    return pa.types.is_dictionary(kind) or any(_has_dictionary(kind.field(i).type) for i in range(kind.num_fields))


def _runs(rows: np.ndarray) -> np.ndarray:
    """[[start, stop], ...] covering `rows` in their order, merging ascending neighbours: an (n, 2) array."""
    if len(rows) == 0:
        return np.empty((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    first = np.concatenate([[0], breaks])
    last = np.concatenate([breaks, [len(rows)]]) - 1
    return np.stack([rows[first], rows[last] + 1], axis=1).astype(np.int64)


class _DataPlane:
    """A node's data port (`datacache.wire`) as this client reaches it, shared by the node's connections: all
    go back to Flight once one finds the port unreachable (or serving another node), and look again, at the
    node's FlightInfo, RECHECK seconds later (a node that restarted serves on another port)."""

    RECHECK = 30.0

    def __init__(self, host: str, meta: dict[str, Any]):
        self.host, self.retry_at = host, 0.0
        self.update(meta)

    def update(self, meta: dict[str, Any]) -> None:
        port, self.node_id = meta.get("data_port"), str(meta.get("node_id", ""))
        self.address, self.usable = (self.host, int(port or 0)), bool(port)

    def unreachable(self) -> None:
        self.usable, self.retry_at = False, time.monotonic() + self.RECHECK

    def due(self) -> bool:
        return not self.usable and time.monotonic() >= self.retry_at


class _Node:
    """One cache node's endpoint, and this process's connection to it (made on first use). A Kubeflow cache's
    worker (`kubeflow`) is asked for rows with IndexPair tickets, a range a call. `data`: its data plane, once
    the node named one."""

    def __init__(self, endpoint: str, token: str | None, timeout: float, tls_root: bytes | None,
                 kubeflow: bool = False, data: _DataPlane | None = None):
        self.endpoint, self.token, self.timeout, self.tls_root = endpoint, token, timeout, tls_root
        self.kubeflow, self.data = kubeflow, data
        self._client = self._options = None
        self.idle: socket.socket | None = None  # a data-plane connection read to its end, for the next call

    def copy(self) -> _Node:
        """The same node, over a connection of its own."""
        return _Node(self.endpoint, self.token, self.timeout, self.tls_root, self.kubeflow, self.data)

    @property
    def options(self) -> flight.FlightCallOptions:
        if self._options is None:
            headers = [(b"authorization", f"Bearer {self.token}".encode())] if self.token else None
            self._options = flight.FlightCallOptions(timeout=self.timeout, headers=headers)
        return self._options

    @property
    def client(self) -> flight.FlightClient:
        if self._client is None or _grpc_pid != os.getpid():
            self._client = _flight_client(self.endpoint, self.tls_root)
        return self._client

    def reset(self) -> None:
        self._client = None
        if self.idle is not None:
            self.idle.close()
            self.idle = None

    def __getstate__(self):
        return {**self.__dict__, "_client": None, "_options": None, "idle": None}


class _Stream:
    """One node's part of a window's steps: one call, a record batch per step, read in order to its end."""

    def __init__(self, node: _Node, steps: list[np.ndarray]):
        self.node, self.steps, self.done = node, steps, 0
        self.client = self.reader = None
        self.since_open = 0  # steps read since the call was (re)made

    @property
    def finished(self) -> bool:
        return self.done == len(self.steps)

    def open(self, client: flight.FlightClient, columns: list[str]) -> None:
        """Asks for the steps not yet read: over the node's data plane where it has one this client reaches,
        else with Flight's do_get."""
        self.close()
        ticket, node, plane = encode_ticket(self.steps[self.done:], columns), self.node, self.node.data
        if plane is not None and plane.due():
            info = client.get_flight_info(flight.FlightDescriptor.for_path("dataset"), node.options)
            plane.update(json.loads(info.app_metadata))
        reader = None
        if plane is not None and plane.usable:
            try:
                idle, node.idle = node.idle, None
                reader = WireReader(plane.address, plane.node_id, node.token, ticket, len(self.steps) - self.done,
                                    node.timeout, idle)
            except Unreachable as e:
                plane.unreachable()
                log.warning("cache node %s: its data port %d cannot be used (%s); reading over Flight, looking "
                            "again in %.0f s", node.endpoint, plane.address[1], e, plane.RECHECK)
        if reader is None:
            reader = client.do_get(flight.Ticket(ticket), node.options)
        self.client, self.reader, self.since_open = client, reader, 0

    def close(self) -> None:
        # A Flight call read to its end has ended; a data-plane connection read to its end serves the node's next
        # call, else it is closed. A call not read to its end is cancelled: the node stops sending what nobody reads.
        if isinstance(self.reader, WireReader):
            idle = self.reader.release()
            if idle is not None:
                old, self.node.idle = self.node.idle, idle
                if old is not None:
                    old.close()
        elif self.reader is not None and not self.finished:
            self.reader.cancel()
        self.reader = None


class _PairReader:
    """A Kubeflow worker's answers to steps, one step a `read_chunk()`: a do_get per run of the step's rows
    with an IndexPair ticket (their protocol asks for one range of rows a call), its rows in the table's
    schema, joined into one record batch of the columns asked for."""

    Chunk = collections.namedtuple("Chunk", "data")

    def __init__(self, client: flight.FlightClient, options: flight.FlightCallOptions, steps: list[np.ndarray],
                 columns: list[str]):
        self.client, self.options, self.steps, self.columns, self.next = client, options, steps, columns, 0

    def read_chunk(self) -> Chunk:
        if self.next == len(self.steps):
            raise StopIteration
        tables = [self.client.do_get(flight.Ticket(kubeflow.encode_index_pair(int(a), int(b) - 1)),
                                     self.options).read_all() for a, b in self.steps[self.next]]
        self.next += 1
        table = pa.concat_tables(tables).select(self.columns).combine_chunks()
        batches = table.to_batches()
        return self.Chunk(batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema))

    def cancel(self) -> None:
        """Nothing to stop: each call was read to its end."""


class _PairStream(_Stream):
    """A Kubeflow worker's part of a window's steps, read step by step through `_PairReader`."""

    def open(self, client: flight.FlightClient, columns: list[str]) -> None:
        reader = _PairReader(client, self.node.options, self.steps[self.done:], columns)
        self.client, self.reader, self.since_open = client, reader, 0


class _Window:
    """Consecutive steps asked for together: which rows each node gives to each step, and a call per node."""

    def __init__(self, layouts: list[tuple[int, int, list]], streams: dict[int, _Stream], last: bool):
        self.layouts, self.streams, self.last, self.read = layouts, streams, last, 0
        self.ready: queue.SimpleQueue = queue.SimpleQueue()  # its steps as read, for the consumer

    def __len__(self) -> int:
        return len(self.layouts)

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()


class _Room:
    """Places for steps asked for and not yet consumed, at most `limit`. `close` (the consumer stopped) and
    `end` (no steps left to ask for) release the readers waiting for room."""

    def __init__(self, limit: int):
        self.free, self.closed, self.ended = limit, False, False
        self.least = (limit + 1) // 2  # a call asks for at least half the room: few calls, each long
        self.waiting = 0  # readers with nothing to read, waiting for room
        self._cond = threading.Condition()

    def reserve(self, wait: bool) -> int:
        """Every free place, once at least half the room is free (waiting for that if `wait`); else 0. A
        reader that does not wait (it has steps to read) leaves the room to one that does."""
        with self._cond:
            if wait:
                self.waiting += 1
                self._cond.wait_for(lambda: self.closed or self.ended or self.free >= self.least)
                self.waiting -= 1
            elif self.waiting:
                return 0
            if self.closed or self.ended or self.free < self.least:
                return 0
            taken, self.free = self.free, 0
            return taken

    def release(self, places: int = 1) -> None:
        with self._cond:
            self.free += places
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self.ended = True
            self._cond.notify_all()


class StreamingDataset(PlannedDataset):
    def __init__(self, endpoints: list[str], columns: list[str] | tuple[str, ...] = ("tokens",),
                 batch_size: int | None = None, global_batch_size: int | None = None, shuffle: bool = True,
                 seed: int = 0, loop: bool = False, drop_last: bool = True, rank: int | None = None,
                 world_size: int | None = None, block_rows: int = 1, window_blocks: int = 1,
                 token: str | None = None, tls_root_cert: str | None = None, timeout: float = 30.0,
                 retries: int = 3, backoff: float = 0.2, prefetch: int = 32, readers: int = 2):
        if not endpoints:
            raise ValueError("StreamingDataset needs at least one cache node endpoint")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch}: give the steps to read ahead, >= 0 (0: none, no thread)")
        if not 1 <= readers <= MAX_READERS:
            raise ValueError(f"readers={readers}: give the threads that read ahead, 1 to {MAX_READERS} (each opens "
                             f"its own connection to every node)")
        self._plan_args = plan_arguments(batch_size, global_batch_size, rank, world_size, shuffle=shuffle, seed=seed,
                                         block_rows=block_rows, window_blocks=window_blocks, drop_last=drop_last)
        self.columns, self.retries, self.backoff, self.prefetch = list(columns), retries, backoff, prefetch
        self.readers = readers
        self.timeout = timeout
        tls_root = None
        if tls_root_cert:
            with open(tls_root_cert, "rb") as f:
                tls_root = f.read()
        token = (os.environ.get(CACHE_TOKEN_ENV) or None) if token is None else token
        heads = [e for e in endpoints if e.startswith(kubeflow.HEAD_SCHEME)]
        if heads and len(endpoints) > 1:
            raise ValueError(f"endpoints={list(endpoints)}: give a Kubeflow cache's head alone (its workers are "
                             f"learned from it), or trainjob nodes only")
        # A Kubeflow cache: its head (plain gRPC, no token); the workers, once known, are the nodes.
        self._head = _Node(heads[0].removeprefix(kubeflow.HEAD_SCHEME), None, timeout, None) if heads else None
        self._nodes = [] if heads else [_Node(e, token, timeout, tls_root) for e in endpoints]
        self._offsets = self._schema = self._sent = self._idle_lanes = None
        super().__init__(None, loop)

    @property
    def patience(self) -> float:
        """Seconds the consumer waits for a batch before it gives up: what a step's retries can take."""
        return 2 * (self.retries + 1) * self.timeout + self.backoff * 2 ** (self.retries + 1) + 2

    @property
    def schema(self) -> pa.Schema:
        self.describe()
        return self._schema

    def describe(self) -> None:
        """Asks every node what it holds, once: from then on `plan` and `schema` are known. Raises
        DataCacheError for an unreachable, refusing or mismatched node, ValueError for too few rows."""
        if self._schema is not None:
            return
        if self._head is not None:
            return self._describe_kubeflow()
        layout = [self._describe(node) for node in self._nodes]
        self._check(layout)
        # The data plane reads no dictionary messages (datacache.wire): such columns stay on Flight.
        plain = not any(_has_dictionary(layout[0][1].field(c).type) for c in self.columns)
        for node, (meta, _) in zip(self._nodes, layout, strict=True):
            host = urllib.parse.urlsplit(node.endpoint).hostname
            if plain and meta.get("data_port") and host and not node.endpoint.startswith("grpc+tls"):
                node.data = _DataPlane(host, meta)
        order = np.argsort([m["offset"] for m, _ in layout])
        self._nodes = [self._nodes[i] for i in order]
        self._offsets = np.array([layout[i][0]["offset"] for i in order] + [layout[order[-1]][0]["total_rows"]])
        self._plan = BatchPlan(num_rows=int(self._offsets[-1]), **self._plan_args)
        self._sent = pa.schema([layout[0][1].field(c) for c in self.columns])  # what each step must hold
        self._schema = layout[0][1]

    def _describe_kubeflow(self) -> None:
        """The table's size and layout from a Kubeflow cache's head (`kubeflow.find_runs`), and its schema from
        the worker holding row 0 (the head's FlightInfo carries a schema of its own, not the table's)."""
        head = self._head

        def holders(index: int, total: int) -> list[flight.FlightEndpoint]:
            descriptor = flight.FlightDescriptor.for_path(str(index), str(total))
            return self._call(head, "get_flight_info", lambda c: c.get_flight_info(descriptor, head.options)).endpoints

        try:
            whole = holders(0, 1)
            rows = 1 + max(kubeflow.decode_index_pair(e.ticket.ticket)[1] for e in whole) if whole else 0
        except ValueError as e:
            raise DataCacheError(f"Kubeflow cache head {head.endpoint}: its tickets are not IndexPairs ({e})") from None
        if rows == 0:
            raise DataCacheError(f"Kubeflow cache head {head.endpoint} names no worker for the table")
        try:
            runs = kubeflow.find_runs(rows, lambda i, t: [e.locations[0].uri.decode() for e in holders(i, t)
                                                          if e.locations])
        except ValueError as e:
            raise DataCacheError(f"Kubeflow cache head {head.endpoint}: {e}") from None
        self._nodes = [_Node(where, None, self.timeout, None, kubeflow=True) for _, _, where in runs]
        self._offsets = np.array([lo for lo, _, _ in runs] + [rows])
        first = self._nodes[0]
        schema = self._call(first, "do_get", lambda c: c.do_get(
            flight.Ticket(kubeflow.encode_index_pair(0, 0)), first.options).read_all()).schema
        missing = [c for c in self.columns if c not in schema.names]
        if missing:
            raise DataCacheError(f"Kubeflow cache worker {first.endpoint} has no column {', '.join(missing)} (it has "
                                 f"{', '.join(schema.names)})")
        self._plan = BatchPlan(num_rows=rows, **self._plan_args)
        self._sent = pa.schema([schema.field(c) for c in self.columns])
        self._schema = schema

    def _make_plan(self) -> BatchPlan:
        self.describe()
        return self._plan

    # --- talking to nodes ------------------------------------------------------------------------------

    def _call(self, node: _Node, what: str, fn):
        for attempt in range(self.retries + 1):
            try:
                return fn(node.client)
            except flight.FlightUnauthenticatedError:
                raise DataCacheError(f"cache node {node.endpoint} refused this client: a wrong or missing "
                                     f"token") from None
            except flight.FlightServerError as e:  # the node answered, and said no: retrying cannot help
                raise DataCacheError(f"cache node {node.endpoint} refused {what}: {_server_reason(e)}") from None
            except RETRYABLE as e:
                node.reset()
                if attempt == self.retries:
                    raise DataCacheError(f"cache node {node.endpoint}: {what} failed {self.retries + 1} times; "
                                         f"last error: {type(e).__name__}: {e}") from None
                time.sleep(self.backoff * 2**attempt)
            except pa.ArrowException as e:  # a refusal of another code (INVALID_ARGUMENT, ...: Kubeflow's)
                raise DataCacheError(f"cache node {node.endpoint} refused {what}: {_server_reason(e)}") from None
        raise AssertionError("unreachable")

    def _describe(self, node: _Node) -> tuple[dict[str, Any], pa.Schema]:
        info = self._call(node, "get_flight_info", lambda c: c.get_flight_info(
            flight.FlightDescriptor.for_path("dataset"), node.options))
        return json.loads(info.app_metadata), info.schema

    def _check(self, layout: list[tuple[dict[str, Any], pa.Schema]]) -> None:
        endpoints = [n.endpoint for n in self._nodes]
        first_meta, first_schema = layout[0]
        for endpoint, (meta, schema) in zip(endpoints, layout, strict=True):
            if not schema.equals(first_schema):
                raise DataCacheError(f"cache node {endpoint} serves schema {schema} but {endpoints[0]} serves "
                                     f"{first_schema}: the nodes must hold parts of one dataset")
            if meta["total_rows"] != first_meta["total_rows"]:
                raise DataCacheError(f"cache node {endpoint} belongs to a dataset of {meta['total_rows']} rows, "
                                     f"{endpoints[0]} to one of {first_meta['total_rows']}")
            missing = [c for c in self.columns if c not in schema.names]
            if missing:
                raise DataCacheError(f"cache node {endpoint} has no column {', '.join(missing)} "
                                     f"(it has {', '.join(schema.names)})")
        spans = sorted((m["offset"], m["offset"] + m["rows"], e) for e, (m, _) in zip(endpoints, layout, strict=True))
        end = 0
        for lo, hi, endpoint in spans:
            if lo != end:
                raise DataCacheError(f"the cache nodes do not cover the dataset's rows exactly: {endpoint} starts at "
                                     f"row {lo}, expected {end} (missing or repeated shard?)")
            end = hi
        if end != first_meta["total_rows"]:
            raise DataCacheError(f"the cache nodes hold rows [0, {end}) of {first_meta['total_rows']}: a shard is "
                                 f"missing from the endpoints")

    def _read(self, stream: _Stream) -> pa.RecordBatch:
        """The stream's next step; a stream that fails is reopened from the first step not yet read."""

        def read(client):
            while True:
                if stream.reader is None or stream.client is not client:
                    stream.open(client, self.columns)
                try:
                    batch = stream.reader.read_chunk().data
                except StopIteration:
                    raise DataCacheError(f"cache node {stream.node.endpoint} ended a stream after {stream.done} of "
                                         f"{len(stream.steps)} steps") from None
                except flight.FlightTimedOutError:
                    if not stream.since_open:
                        raise
                    stream.close()  # the call's deadline ended a stream that was delivering: go on anew
                    continue
                stream.done += 1
                stream.since_open += 1
                return batch

        return self._call(stream.node, "do_get", read)

    def _checked(self, stream: _Stream, batch: pa.RecordBatch, rows: int) -> pa.RecordBatch:
        """`batch` if it is what was asked of the node: `rows` rows of the columns and types it described."""
        expected = self._sent
        if batch.num_rows != rows:
            raise DataCacheError(f"cache node {stream.node.endpoint} answered a step with {batch.num_rows} rows where "
                                 f"{rows} were asked for")
        if not batch.schema.equals(expected):
            got = ", ".join(f"{f.name}: {f.type}" for f in batch.schema)
            raise DataCacheError(f"cache node {stream.node.endpoint} answered with columns {got}; asked for "
                                 f"{', '.join(f'{f.name}: {f.type}' for f in expected)}")
        return batch

    # --- batches ---------------------------------------------------------------------------------------

    def _window(self, planned, max_steps: int, nodes: list[_Node]) -> _Window:
        """The next planned steps, up to `max_steps` and about `SPAN_RUNS` row ranges, as one call per node
        (over the connections of `nodes`)."""
        layouts, wanted, runs, last = [], collections.defaultdict(list), 0, False
        while len(layouts) < max_steps and runs < SPAN_RUNS:
            try:
                g, rows = next(planned)
            except StopIteration:
                last = True
                break
            lo, hi = np.searchsorted(self._offsets, (rows.min(), rows.max()), side="right") - 1
            if lo == hi:  # one node holds the whole step: the common case, and the zero-copy one
                parts = [(int(lo), None)]
                wanted[int(lo)].append(_runs(rows))
            else:
                owner = np.searchsorted(self._offsets, rows, side="right") - 1
                parts = [(int(n), np.flatnonzero(owner == n)) for n in np.unique(owner)]
                for n, where in parts:
                    wanted[n].append(_runs(rows[where]))
            runs += sum(len(wanted[n][-1]) for n, _ in parts)
            layouts.append((g, len(rows), parts))
        return _Window(layouts, {n: (_PairStream if nodes[n].kubeflow else _Stream)(nodes[n], steps)
                                 for n, steps in wanted.items()}, last)

    def _open(self, window: _Window) -> None:
        """Makes the window's calls, so that every node sends before any is read."""
        for stream in window.streams.values():
            self._call(stream.node, "do_get", lambda client, s=stream: s.open(client, self.columns))

    def _next_step(self, window: _Window) -> tuple[int, dict[str, torch.Tensor]]:
        g, count, parts = window.layouts[window.read]
        batches = []
        for n, where in parts:
            stream = window.streams[n]
            batches.append(self._checked(stream, self._read(stream), count if where is None else len(where)))
        window.read += 1
        return g, self._assemble(count, parts, batches)

    def _assemble(self, count: int, parts: list[tuple[int, np.ndarray | None]], batches: list[pa.RecordBatch]):
        if len(batches) == 1:
            return {c: _to_tensor(batches[0].column(c)) for c in self.columns}
        out = {}
        for c in self.columns:
            # Assembled in numpy: torch cannot scatter into every dtype Arrow holds (uint16 tokens, say).
            pieces = [_to_numpy(b.column(c)) for b in batches]
            merged = np.empty((count, *pieces[0].shape[1:]), dtype=pieces[0].dtype)
            for (_, where), piece in zip(parts, pieces, strict=True):
                merged[where] = piece
            out[c] = _to_tensor(merged)
        return out

    def fetch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        self.describe()
        window = self._window(iter([(0, rows)]), 1, self._nodes)
        try:
            self._open(window)
            return self._next_step(window)[1]
        finally:
            window.close()

    def _fetched(self, planned):
        self.describe()
        if not keep_freed_buffers() and chosen() == "release":
            log.info("the reading process keeps glibc's release policy (train.allocator): each batch buffer is "
                     "mapped and faulted in anew")
        planned = iter(planned)
        if self.prefetch <= 0:  # a call per step, made when the step is wanted
            while len(window := self._window(planned, 1, self._nodes)):
                try:
                    self._open(window)
                    step = self._next_step(window)
                finally:
                    window.close()
                yield step
            return
        if self._idle_lanes is None:
            self._idle_lanes = [self._nodes]  # the first reader uses the connections `describe` made
        order: queue.SimpleQueue = queue.SimpleQueue()  # windows as cut, None after the last
        room, cutting = _Room(self.prefetch), threading.Lock()
        try:
            for _ in range(min(self.readers, self.prefetch)):  # no more readers than places to read into
                threading.Thread(target=self._produce, args=(self._lane(), planned, room, cutting, order),
                                 name="datacache-fetch", daemon=True).start()
            while (window := self._wait(order)) is not None:
                for _ in range(len(window)):
                    step = self._wait(window.ready)
                    room.release()
                    yield step
        finally:
            room.close()

    def _lane(self) -> list[_Node]:
        """Connections to every node for one reader: those of a reader that has finished, else new ones. A
        reader of an iteration stopped early may still be finishing a read: it keeps its own."""
        try:
            return self._idle_lanes.pop()
        except IndexError:
            return [n.copy() for n in self._nodes]

    def _wait(self, ready: queue.SimpleQueue):
        """The next item a reader handed over; raises what a reader raised, or when none comes in time."""
        try:
            item = ready.get(timeout=self.patience)
        except queue.Empty:
            raise DataCacheError(
                f"no batch from the cache nodes {', '.join(n.endpoint for n in self._nodes)} in "
                f"{self.patience:.0f} s (timeout={self.timeout} s, retries={self.retries})") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _produce(self, nodes: list[_Node], planned, room: _Room, cutting: threading.Lock,
                 order: queue.SimpleQueue) -> None:
        """A read-ahead thread, one of `readers`, each over its own connections (`nodes`): takes the next
        window of steps as the room allows (windows are cut and handed to the consumer in plan order, under
        `cutting`), makes its calls, and reads its windows in order, each call to its end, handing each step
        to its window. An error goes to the first window it has not finished (the consumer reaches that
        one first), else to the consumer's queue of windows."""
        windows: collections.deque[_Window] = collections.deque()
        try:
            while True:
                if places := room.reserve(wait=not windows):  # 0 once the plan has ended
                    with cutting:
                        window = (None if room.ended or room.closed
                                  else self._cut(planned, min(places, SPAN_STEPS), nodes, room))
                        room.release(places - (len(window) if window else 0))
                        if window is not None:
                            if len(window):
                                windows.append(window)  # before opening: the finally below closes what did open
                                order.put(window)
                            if window.last:
                                room.end()
                                order.put(None)
                    if window is not None and len(window):
                        self._open(window)
                if room.closed or not windows:
                    return
                window = windows[0]
                window.ready.put(self._next_step(window))
                if window.read == len(window):
                    windows.popleft().close()
        except BaseException as e:  # handed to the consumer, which raises it
            (windows[0].ready if windows else order).put(e)
        finally:
            for window in windows:
                window.close()
            self._idle_lanes.append(nodes)

    def _cut(self, planned, max_steps: int, nodes: list[_Node], room: _Room) -> _Window:
        """The next window; if cutting it fails, no reader cuts another (so no end of the epoch is announced
        before the error reaches the consumer)."""
        try:
            return self._window(planned, max_steps, nodes)
        except BaseException:
            room.end()
            raise
