"""A test double of Kubeflow Trainer's data cache (a head and its workers), written from its protocol as
kubeflow/trainer `pkg/data_cache` speaks it (`head_service.rs`, `worker_service.rs`), because the real one, a
Rust server over DataFusion, cannot be built here. Written apart from `datacache.kubeflow` (its own ticket
codec) so that the two are checked against each other, not against themselves.

- The head is a gRPC server (grpcio) answering Flight's `GetFlightInfo` alone, with Kubeflow's status
  codes: INVALID_ARGUMENT for a path that is not two integers, OUT_OF_RANGE for an empty partition.
  Partition `index` of `total` is rows `[index*k, min((index+1)*k, N))`, `k = ceil(N / total)`; its
  endpoints are one per worker holding part of it, each with one location `grpc://127.0.0.1:<port>` and the
  partition's own `IndexPair` (the same ticket for every worker, as Kubeflow's head gives), and the head's
  FlightInfo carries its own schema, not the table's (as Kubeflow's does).
- The table's files go to the workers round robin (file i to worker i % W), as Kubeflow's head deals them
  out, so a worker holds several separate runs of rows. A worker (a pyarrow Flight server) answers
  `do_get(IndexPair{start, end})` with the rows it holds in `[start, end]`, in the table's schema, in
  record batches of `batch_rows`; a ticket that is not a pair is INVALID_ARGUMENT.
"""

from __future__ import annotations

import struct
import threading
from concurrent import futures

import grpc
import pyarrow as pa
import pyarrow.flight as flight
import pyarrow.parquet as pq

# The head's FlightInfo schema in Kubeflow's head_service.rs (its file-assignment table), not the data's.
HEAD_SCHEMA = pa.schema([("worker_ids", pa.uint64()), ("row_start_indexes", pa.uint64()),
                         ("row_end_indexes", pa.uint64()), ("file_paths", pa.list_(pa.string()))])


def _u64(value: int) -> bytes:
    if value < 251:
        return bytes([value])
    if value < 1 << 16:
        return b"\xfb" + struct.pack("<H", value)
    if value < 1 << 32:
        return b"\xfc" + struct.pack("<I", value)
    return b"\xfd" + struct.pack("<Q", value)


def pair_ticket(start: int, end: int) -> bytes:
    return _u64(start) + _u64(end)


def read_pair(ticket: bytes) -> tuple[int, int]:
    values, pos = [], 0
    for _ in range(2):
        tag = ticket[pos]
        width = {0xFB: 2, 0xFC: 4, 0xFD: 8}.get(tag, 0)
        if tag >= 251 and not width:
            raise ValueError("Invalid ticket format")
        values.append(tag if not width else int.from_bytes(ticket[pos + 1:pos + 1 + width], "little"))
        pos += 1 + width
    if pos != len(ticket):
        raise ValueError("Invalid ticket format")
    return values[0], values[1]


class Worker(flight.FlightServerBase):
    def __init__(self, runs: list[tuple[int, pa.Table]], batch_rows: int):
        super().__init__("grpc://127.0.0.1:0")
        self.runs, self.batch_rows, self.calls = runs, batch_rows, 0
        self.schema = runs[0][1].schema

    def do_get(self, context, ticket):
        try:
            start, end = read_pair(ticket.ticket)
        except (ValueError, IndexError):
            raise pa.ArrowInvalid("Invalid ticket format") from None  # INVALID_ARGUMENT
        self.calls += 1
        parts = []
        for first, table in self.runs:
            lo, hi = max(start, first), min(end + 1, first + table.num_rows)
            if lo < hi:
                parts.append(table.slice(lo - first, hi - lo))
        rows = pa.concat_tables(parts) if parts else self.schema.empty_table()
        return flight.RecordBatchStream(rows.combine_chunks(), options=None) if rows.num_rows <= self.batch_rows \
            else flight.GeneratorStream(self.schema, rows.to_batches(max_chunksize=self.batch_rows))


class KubeflowCache:
    """A head and `workers` workers over the Parquet `files` (in order): `head` is `grpc://127.0.0.1:<port>`."""

    def __init__(self, files: list[str], workers: int = 2, batch_rows: int = 256):
        tables = [pq.read_table(f) for f in files]
        starts = [sum(t.num_rows for t in tables[:i]) for i in range(len(tables))]
        self.rows = sum(t.num_rows for t in tables)
        placed = list(enumerate(zip(starts, tables, strict=True)))  # (file, (first row, rows))
        self.files = [(i % workers, start, start + t.num_rows - 1) for i, (start, t) in placed]
        self.workers = [Worker([(s, t) for i, (s, t) in placed if i % workers == w], batch_rows)
                        for w in range(workers)]
        for w in self.workers:
            threading.Thread(target=w.serve, daemon=True).start()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.unary_unary_rpc_method_handler(self._get_flight_info,
                                                      request_deserializer=flight.FlightDescriptor.deserialize,
                                                      response_serializer=lambda info: info.serialize())
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "arrow.flight.protocol.FlightService", {"GetFlightInfo": handler})])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.head = f"grpc://127.0.0.1:{self.port}"

    def _get_flight_info(self, descriptor: flight.FlightDescriptor, context) -> flight.FlightInfo:
        path = [p.decode() for p in descriptor.path or []]
        if len(path) < 2:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Missing total in path" if path else
                          "Missing local_rank in path")
        if not path[1].isdigit():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Invalid total value")
        if not path[0].isdigit():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Invalid local_rank value")
        index, total = int(path[0]), int(path[1])
        if self.rows == 0 or total == 0 or index >= total or index * -(-self.rows // total) >= self.rows:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, "Invalid partition range")
        k = -(-self.rows // total)
        start, end = index * k, min((index + 1) * k, self.rows) - 1
        ticket = pair_ticket(start, end)
        holders = []
        for worker, lo, hi in self.files:
            if lo <= end and hi >= start and worker not in holders:
                holders.append(worker)
        endpoints = [flight.FlightEndpoint(ticket, [f"grpc://127.0.0.1:{self.workers[w].port}"], app_metadata=ticket)
                     for w in holders]
        return flight.FlightInfo(HEAD_SCHEMA, descriptor, endpoints, -1, -1)

    def close(self) -> None:
        self.server.stop(None)
        for w in self.workers:
            w.shutdown()
