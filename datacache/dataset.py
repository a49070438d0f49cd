"""`StreamingDataset`: this rank's batches of a dataset held by cache nodes (`datacache.server`).

Given every node's endpoint, the client sees one dataset: each node says which global rows it holds,
and all must share one schema and cover the rows without gaps. Each step's rows (by `BatchPlan`: the
same order, sharding, epochs and resumption as `LocalDataset`) are asked of the nodes that hold them as
runs of neighbouring rows. A thread reads up to `prefetch` steps ahead (Flight releases the GIL) from one
long Flight stream per node, all nodes sending at once: a gRPC stream starts slowly, so one call carries
up to `SPAN_STEPS` steps. When `prefetch` steps wait unconsumed the streams close, so that a node never
sends what is not yet wanted nor waits on a slow consumer, and they reopen at the first step not yet read.
A batch that one node answers in one piece becomes a torch tensor without a copy. `prefetch=0`: no
thread, one call per step, made when the step is wanted.

A node that cannot be reached, or fails mid-stream, is retried `retries` times with exponential backoff
(its stream resumes at the first step it had not delivered); then the error names the endpoint. A call's
`timeout` is its deadline: a stream that is delivering when it passes goes on in a new call, not counted
as a failure. A wrong or missing token is refused at once.

gRPC does not survive `fork`: with DataLoader worker processes, pass `multiprocessing_context="forkserver"`
(or "spawn"); the dataset pickles without its connections. Threads in the rank process (`num_workers=0`
and `prefetch`) are faster still, and start at once.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import threading
import time
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import torch

from datacache.local import token_matrix
from datacache.order import BatchPlan
from datacache.planned import PlannedDataset, rank_and_world
from datacache.server import DataCacheError, encode_ticket

# A stream carries up to this many steps, or about this many row ranges (16 bytes each in its ticket).
SPAN_STEPS, SPAN_RUNS = 1024, 65536

RETRYABLE = (flight.FlightUnavailableError, flight.FlightTimedOutError, flight.FlightInternalError,
             flight.FlightCancelledError, ConnectionError, OSError)


def _to_numpy(column: pa.Array) -> np.ndarray:
    """A fixed-size list column as a 2-D array, a primitive column as 1-D; zero-copy when possible."""
    if pa.types.is_fixed_size_list(column.type):
        return token_matrix(column, "a cached column")
    return column.to_numpy(zero_copy_only=False)


def _to_tensor(column: pa.Array | np.ndarray) -> torch.Tensor:
    values = _to_numpy(column) if isinstance(column, pa.Array) else column
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Arrow's buffers are read-only; we never write them
        return torch.from_numpy(values)


def _runs(rows: np.ndarray) -> np.ndarray:
    """[[start, stop], ...] covering `rows` in their order, merging ascending neighbours: an (n, 2) array."""
    if len(rows) == 0:
        return np.empty((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    first = np.concatenate([[0], breaks])
    last = np.concatenate([breaks, [len(rows)]]) - 1
    return np.stack([rows[first], rows[last] + 1], axis=1).astype(np.int64)


class _Node:
    """One cache node's endpoint, and this process's connection to it (made on first use)."""

    def __init__(self, endpoint: str, token: str | None, timeout: float, tls_root: bytes | None):
        self.endpoint, self.token, self.timeout, self.tls_root = endpoint, token, timeout, tls_root
        self._client = self._options = None

    @property
    def options(self) -> flight.FlightCallOptions:
        if self._options is None:
            headers = [(b"authorization", f"Bearer {self.token}".encode())] if self.token else None
            self._options = flight.FlightCallOptions(timeout=self.timeout, headers=headers)
        return self._options

    @property
    def client(self) -> flight.FlightClient:
        if self._client is None:
            self._client = flight.FlightClient(self.endpoint, tls_root_certs=self.tls_root)
        return self._client

    def reset(self) -> None:
        self._client = None

    def __getstate__(self):
        return {**self.__dict__, "_client": None, "_options": None}


class _Stream:
    """One node's answer to a run of steps: a record batch per step, read in order."""

    def __init__(self, node: _Node, steps: list[np.ndarray]):
        self.node, self.steps, self.done = node, steps, 0
        self.client = self.reader = None
        self.since_open = 0  # steps read since the call was (re)made

    @property
    def finished(self) -> bool:
        return self.done == len(self.steps)

    def open(self, client: flight.FlightClient, columns: list[str]) -> None:
        """Asks for the steps not yet read."""
        ticket = flight.Ticket(encode_ticket(self.steps[self.done:], columns))
        self.client, self.reader, self.since_open = client, client.do_get(ticket, self.node.options), 0

    def close(self) -> None:
        if self.reader is not None and not self.finished:
            self.reader.cancel()  # the node stops sending steps nobody will read now
        self.reader = None


class _Span:
    """A run of steps: which rows each node gives to each step, and one stream per node delivering them."""

    def __init__(self, layouts: list[tuple[int, int, list]], streams: dict[int, _Stream]):
        self.layouts, self.streams = layouts, streams

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()


class _Room:
    """Steps fetched ahead and not yet consumed, at most `limit`; `close` releases a waiting fetcher."""

    def __init__(self, limit: int):
        self.limit, self.held, self.closed = limit, 0, False
        self._cond = threading.Condition()

    def take(self) -> bool:
        """A place for one more step, if there is one now."""
        with self._cond:
            if self.closed or self.held >= self.limit:
                return False
            self.held += 1
            return True

    def take_when_half_empty(self) -> bool:
        """A place for one more step, once at most half the room is held (False if closed meanwhile)."""
        with self._cond:
            self._cond.wait_for(lambda: self.closed or self.held <= self.limit // 2)
            if self.closed:
                return False
            self.held += 1
            return True

    def give(self) -> None:
        with self._cond:
            self.held -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class StreamingDataset(PlannedDataset):
    def __init__(self, endpoints: list[str], columns: list[str] | tuple[str, ...] = ("tokens",),
                 batch_size: int | None = None, global_batch_size: int | None = None, shuffle: bool = True,
                 seed: int = 0, loop: bool = True, drop_last: bool = True, rank: int | None = None,
                 world_size: int | None = None, block_rows: int = 1, window_blocks: int = 1,
                 token: str | None = None, tls_root_cert: str | None = None, timeout: float = 30.0,
                 retries: int = 3, backoff: float = 0.2, prefetch: int = 8):
        if (batch_size is None) == (global_batch_size is None):
            raise ValueError("give exactly one of batch_size (per rank) and global_batch_size")
        if not endpoints:
            raise ValueError("StreamingDataset needs at least one cache node endpoint")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch}: give the steps to read ahead, >= 0 (0: none, no thread)")
        env_rank, env_world = rank_and_world()
        rank = env_rank if rank is None else rank
        world = env_world if world_size is None else world_size
        self.columns, self.retries, self.backoff, self.prefetch = list(columns), retries, backoff, prefetch
        tls_root = None
        if tls_root_cert:
            with open(tls_root_cert, "rb") as f:
                tls_root = f.read()
        self._nodes = [_Node(e, token, timeout, tls_root) for e in endpoints]
        self._pid = os.getpid()
        layout = [self._describe(node) for node in self._nodes]
        self._check(layout)
        order = np.argsort([m["offset"] for m, _ in layout])
        self._nodes = [self._nodes[i] for i in order]
        self._offsets = np.array([layout[i][0]["offset"] for i in order] + [layout[order[-1]][0]["total_rows"]])
        self.schema = layout[0][1]
        total = int(self._offsets[-1])
        super().__init__(BatchPlan(
            num_rows=total, global_batch_size=global_batch_size or batch_size * world, world_size=world,
            rank=rank, shuffle=shuffle, seed=seed, block_rows=block_rows, window_blocks=window_blocks,
            drop_last=drop_last), loop)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._pid = os.getpid()  # unpickled in a fresh process: its own connections, made on first use

    # --- talking to nodes ------------------------------------------------------------------------------

    def _call(self, node: _Node, what: str, fn):
        if os.getpid() != self._pid:
            raise DataCacheError("StreamingDataset cannot run in a forked process (gRPC does not survive fork): "
                                 "give the DataLoader multiprocessing_context='forkserver' (or 'spawn'), or use "
                                 "num_workers=0 and the dataset's prefetch threads")
        for attempt in range(self.retries + 1):
            try:
                return fn(node.client)
            except flight.FlightUnauthenticatedError:
                raise DataCacheError(f"cache node {node.endpoint} refused this client: a wrong or missing "
                                     f"token") from None
            except RETRYABLE as e:
                node.reset()
                if attempt == self.retries:
                    raise DataCacheError(f"cache node {node.endpoint}: {what} failed {self.retries + 1} times; "
                                         f"last error: {type(e).__name__}: {e}") from None
                time.sleep(self.backoff * 2**attempt)
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
                    stream.reader = None  # the call's deadline ended a stream that was delivering: go on anew
                    continue
                stream.done += 1
                stream.since_open += 1
                return batch

        return self._call(stream.node, "do_get", read)

    # --- batches ---------------------------------------------------------------------------------------

    def _spans(self, planned, max_steps: int = SPAN_STEPS):
        """The planned steps in spans of up to `max_steps` steps and about `SPAN_RUNS` row ranges (a ticket)."""
        while True:
            layouts, wanted, runs = [], collections.defaultdict(list), 0
            for g, rows in planned:
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
                if len(layouts) == max_steps or runs >= SPAN_RUNS:
                    break
            if not layouts:
                return
            yield _Span(layouts, {n: _Stream(self._nodes[n], steps) for n, steps in wanted.items()})

    def _open_streams(self, span: _Span) -> None:
        """(Re)opens the span's unfinished streams, so that every node sends before any is read."""
        for stream in span.streams.values():
            if stream.reader is None and not stream.finished:
                self._call(stream.node, "do_get", lambda client, s=stream: s.open(client, self.columns))

    def _steps(self, span: _Span, room: _Room | None = None):
        """(global step, batch) for each step of the span. With `room`, a step is read only when there is room
        for it; when there is none the streams close until the consumer has caught up by half the room (a
        node sends only what is wanted, and a slow consumer costs a call per half room, not per step)."""
        try:
            for g, count, parts in span.layouts:
                if room is not None and not room.take():
                    span.close()
                    if not room.take_when_half_empty():
                        return
                self._open_streams(span)
                yield g, self._assemble(count, parts, [self._read(span.streams[n]) for n, _ in parts])
        finally:
            span.close()

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
        return next(self._steps(next(self._spans(iter([(0, rows)])))))[1]

    def _fetched(self, planned):
        if self.prefetch <= 0:  # a call per step, made when the step is wanted
            for span in self._spans(planned, max_steps=1):
                yield from self._steps(span)
            return
        # A thread reads ahead, up to `prefetch` steps, from one long stream per node: a new stream's first
        # messages come several times slower than the rest (measured: 3-6 ms against 1.5 for 4 MiB), so
        # calls are few and long.
        ready: queue.SimpleQueue = queue.SimpleQueue()
        room = _Room(self.prefetch)

        def produce():
            try:
                for span in self._spans(planned):
                    for item in self._steps(span, room):
                        ready.put(item)
                    if room.closed:
                        return
                ready.put(None)
            except BaseException as e:  # handed to the consumer, which raises it
                ready.put(e)

        threading.Thread(target=produce, name="datacache-fetch", daemon=True).start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                room.give()
                yield item
        finally:
            room.close()
