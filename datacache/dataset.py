"""`StreamingDataset`: this rank's batches of a dataset held by cache nodes (`datacache.server`).

Given every node's endpoint, the client sees one dataset: each node says which global rows it holds,
and all must share one schema and cover the rows without gaps. Each step's rows (by `BatchPlan`: the
same order, sharding, epochs and resumption as `LocalDataset`) are fetched from the nodes that hold them,
in parallel, as runs of neighbouring rows; `prefetch` steps are fetched ahead in threads (Flight
releases the GIL). A batch that one node answers in one piece becomes a torch tensor without a copy.

A node that cannot be reached, or fails mid-stream, is retried `retries` times with exponential backoff;
then the error names the endpoint. A wrong or missing token is refused at once.

gRPC does not survive `fork`: with DataLoader worker processes, pass `multiprocessing_context="forkserver"`
(or "spawn"); the dataset pickles without its connections. Threads in the rank process (`num_workers=0`
and `prefetch`) are faster still, and start at once.
"""

from __future__ import annotations

import collections
import json
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import torch

from datacache.local import token_matrix
from datacache.order import BatchPlan
from datacache.planned import PlannedDataset, rank_and_world
from datacache.server import DataCacheError

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


def _runs(rows: np.ndarray) -> list[list[int]]:
    """[[start, stop], ...] covering `rows` in their order, merging ascending neighbours."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(rows)]])
    return [[int(rows[a]), int(rows[b - 1]) + 1] for a, b in zip(starts, stops, strict=True)]


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


class StreamingDataset(PlannedDataset):
    def __init__(self, endpoints: list[str], columns: list[str] | tuple[str, ...] = ("tokens",),
                 batch_size: int | None = None, global_batch_size: int | None = None, shuffle: bool = True,
                 seed: int = 0, loop: bool = True, drop_last: bool = True, rank: int | None = None,
                 world_size: int | None = None, block_rows: int = 64, window_blocks: int = 16,
                 token: str | None = None, tls_root_cert: str | None = None, timeout: float = 30.0,
                 retries: int = 3, backoff: float = 0.2, prefetch: int = 2):
        if (batch_size is None) == (global_batch_size is None):
            raise ValueError("give exactly one of batch_size (per rank) and global_batch_size")
        if not endpoints:
            raise ValueError("StreamingDataset needs at least one cache node endpoint")
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

    def _get(self, node: _Node, ranges: list[list[int]]) -> pa.RecordBatch:
        ticket = flight.Ticket(json.dumps({"ranges": ranges}).encode())

        def read(client):
            # The node answers with one record batch; reading it as such avoids concatenating a table.
            reader = client.do_get(ticket, node.options)
            batches = [chunk.data for chunk in reader]
            batch = batches[0] if len(batches) == 1 else pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
            return batch.select(self.columns)

        return self._call(node, "do_get", read)

    # --- batches ---------------------------------------------------------------------------------------

    def fetch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        owner = np.searchsorted(self._offsets, rows, side="right") - 1
        parts = [(n, np.flatnonzero(owner == n)) for n in np.unique(owner)]
        if len(parts) == 1:
            batch = self._get(self._nodes[parts[0][0]], _runs(rows))
            return {c: _to_tensor(batch.column(c)) for c in self.columns}
        with ThreadPoolExecutor(len(parts)) as pool:
            batches = list(pool.map(lambda p: self._get(self._nodes[p[0]], _runs(rows[p[1]])), parts))
        out = {}
        for c in self.columns:
            # Assembled in numpy: torch cannot scatter into every dtype Arrow holds (uint16 tokens, say).
            pieces = [_to_numpy(b.column(c)) for b in batches]
            merged = np.empty((len(rows), *pieces[0].shape[1:]), dtype=pieces[0].dtype)
            for (_, where), piece in zip(parts, pieces, strict=True):
                merged[where] = piece
            out[c] = _to_tensor(merged)
        return out

    def _fetched(self, planned):
        if self.prefetch <= 0:
            yield from super()._fetched(planned)
            return
        with ThreadPoolExecutor(self.prefetch) as pool:
            pending: collections.deque = collections.deque()
            for g, rows in planned:
                pending.append((g, pool.submit(self.fetch, rows)))
                if len(pending) > self.prefetch:
                    g0, future = pending.popleft()
                    yield g0, future.result()
            while pending:
                g0, future = pending.popleft()
                yield g0, future.result()
