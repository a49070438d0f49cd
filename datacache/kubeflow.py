"""Kubeflow Trainer's data cache protocol (the `torch-distributed-with-cache` runtime), as its clients and
servers speak it: what a trainjob node answers to Kubeflow's client, and what `StreamingDataset` asks of
Kubeflow's head and workers. Written from the protocol (kubeflow/trainer `pkg/data_cache`: the head's
`get_flight_info`, the workers' `do_get`, the `DataCacheDataset` example), not from its code.

- A client of `total` (DataLoader workers x world size) asks the head for partition `index` with
  `FlightDescriptor.for_path(str(index), str(total))`; partition `index` is rows `[index*k, min((index+1)*k,
  N))`, `k = ceil(N / total)`, and there is no empty partition (the head refuses one).
- The answer has an endpoint per worker holding part of the partition, each with one location and a
  ticket: an `IndexPair{start: u64, end: u64}` (`end` inclusive) in bincode 2's standard encoding, two
  varints (below 251 one byte; else 0xFB + u16, 0xFC + u32, 0xFD + u64, little-endian).
- `do_get(IndexPair)` on a worker streams the rows it holds in `[start, end]`, in the table's own schema.

No torch here: a cache node imports this module.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

# A StreamingDataset endpoint naming a Kubeflow cache's head (its Service), e.g.
# kubeflow+grpc://<train-job>-cache-service:50051.
HEAD_SCHEME = "kubeflow+"
PORT = 50051  # the head's and the workers' Flight port in the runtime
HEALTH_PORT = 8080  # their readiness port: HTTP GET /ready

_WIDE = ((0xFB, "<H", 1 << 16), (0xFC, "<I", 1 << 32), (0xFD, "<Q", 1 << 64))
MAX_PAIR_BYTES = 18  # two varints of at most 9 bytes


def _varint(value: int) -> bytes:
    if value < 251:
        return bytes([value])
    for tag, fmt, limit in _WIDE:
        if value < limit:
            return bytes([tag]) + struct.pack(fmt, value)
    raise ValueError(f"{value} does not fit a u64")


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(data):
        raise ValueError("it ends inside a number")
    tag = data[pos]
    if tag < 251:
        return tag, pos + 1
    for wide_tag, fmt, _ in _WIDE:
        if tag == wide_tag:
            size = struct.calcsize(fmt)
            if pos + 1 + size > len(data):
                raise ValueError("it ends inside a number")
            return struct.unpack_from(fmt, data, pos + 1)[0], pos + 1 + size
    raise ValueError(f"byte 0x{tag:02x} starts no u64")


def encode_index_pair(start: int, end: int) -> bytes:
    """The ticket for rows `[start, end]` (`end` inclusive): `encode_index_pair(0, 4999) == b"\\x00\\xfb\\x87\\x13"`."""
    if not (0 <= start < 1 << 64 and 0 <= end < 1 << 64):
        raise ValueError(f"IndexPair{{start: {start}, end: {end}}}: row numbers are u64, >= 0")
    return _varint(start) + _varint(end)


def decode_index_pair(ticket: bytes) -> tuple[int, int]:
    """(start, end) of an IndexPair ticket; ValueError unless `ticket` is exactly one."""
    start, pos = _read_varint(ticket, 0)
    end, pos = _read_varint(ticket, pos)
    if pos != len(ticket):
        raise ValueError(f"{len(ticket) - pos} bytes after the pair")
    return start, end


def is_index_pair(ticket: bytes) -> bool:
    """Whether `ticket` is an IndexPair (a datacache ticket is a JSON line and more, never 18 bytes or fewer)."""
    if len(ticket) > MAX_PAIR_BYTES:
        return False
    try:
        decode_index_pair(ticket)
    except ValueError:
        return False
    return True


def partition(rows: int, index: int, total: int) -> tuple[int, int] | None:
    """Partition `index` of `total` of a table of `rows` rows as (start, end), `end` inclusive; None where the
    head refuses it (an empty partition, or an index not below `total`)."""
    if rows <= 0 or total <= 0 or not 0 <= index < total:
        return None
    size = -(-rows // total)
    start = index * size
    return (start, min(start + size, rows) - 1) if start < rows else None


def find_runs(rows: int, holders: Callable[[int, int], list[str]]) -> list[tuple[int, int, str]]:
    """Which worker holds which rows of a table of `rows` rows, learned from the head alone: runs `(first,
    after the last, worker location)` covering `[0, rows)` in order, neighbours with the same worker merged.

    The head says which workers hold part of a partition (`holders(index, total)`: the endpoints' locations),
    and partitions are aligned ranges of `ceil(rows / total)` rows; a partition with one holder is that
    worker's whole. So: partitions of the whole table, then of each range not yet known, twice as many each
    round, down to single rows. That is a few calls per boundary between runs, not one per row. A row that
    several workers claim is read from the first the head names."""
    known: list[tuple[int, int, str]] = []
    pending = [(0, rows)]
    total = 1
    while pending:
        size = -(-rows // total)
        still = []
        for a, b in pending:
            for index in range(a // size, (b - 1) // size + 1):
                lo, hi = max(a, index * size), min(b, (index + 1) * size)
                where = holders(index, total)
                if len(set(where)) == 1 or (size == 1 and where):
                    known.append((lo, hi, where[0]))
                elif size == 1:
                    raise ValueError(f"the head names no worker holding row {lo}")
                elif still and still[-1][1] == lo:
                    still[-1] = (still[-1][0], hi)
                else:
                    still.append((lo, hi))
        pending, total = still, min(total * 2, rows)
    runs: list[tuple[int, int, str]] = []
    for lo, hi, where in sorted(known):
        if runs and runs[-1][1] == lo and runs[-1][2] == where:
            runs[-1] = (runs[-1][0], hi, where)
        else:
            runs.append((lo, hi, where))
    return runs
