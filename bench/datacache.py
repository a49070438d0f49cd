"""Data throughput into torch tensors: Parquet read directly, the in-process LocalDataset, one Arrow
Flight cache node to one client and to two clients, against the raw loopback TCP ceiling.

Rows are fixed-length lists of `--tokens` int32 ids (2 KB per row at 512). Every source is read in
batches of about `--batch-mb` MB (`--rows` rows in all, unshuffled) and each batch ends as a torch
tensor. The cache node and the TCP sender run in their own processes, as they would on a cluster; the
TCP ceiling receives the same bytes with `recv_into` into one preallocated buffer per batch.

    python bench/datacache.py [--rows 100000] [--tokens 512] [--batch-mb 4] [--epochs 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from datacache import LocalDataset, StreamingDataset  # noqa: E402
from datacache.local import token_matrix  # noqa: E402


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return min(times)


def _tcp_sender(port: int, total: int, chunk: int, repeats: int, ready) -> None:
    payload = np.random.default_rng(0).integers(0, 2**31, chunk // 4, dtype=np.int32).tobytes()
    with socket.create_server(("127.0.0.1", port)) as server:
        ready.set()
        for _ in range(repeats):
            conn, _ = server.accept()
            with conn:
                sent = 0
                while sent < total:
                    conn.sendall(payload[:min(chunk, total - sent)])
                    sent += min(chunk, total - sent)


def tcp_ceiling(total: int, chunk: int, row_bytes: int, repeats: int) -> float:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = ctx.Process(target=_tcp_sender, args=(port, total, chunk, repeats, ready), daemon=True)
    sender.start()
    ready.wait(30)

    def receive():
        with socket.create_connection(("127.0.0.1", port)) as conn:
            got = 0
            while got < total:
                buf = bytearray(min(chunk, total - got))
                view, n = memoryview(buf), 0
                while n < len(buf):
                    n += conn.recv_into(view[n:])
                torch.frombuffer(buf, dtype=torch.int32).view(-1, row_bytes // 4)
                got += len(buf)

    seconds = _best(receive, repeats)
    sender.join(10)
    return seconds


MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}


def main() -> None:
    # glibc read these at start-up: keeping freed memory instead of returning it to the OS saves a page
    # fault per byte of every fresh receive buffer. Set them for this process too, by starting over.
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch-mb", type=float, default=4.0)
    parser.add_argument("--epochs", type=int, default=3, help="repeats; the best is reported")
    args = parser.parse_args()
    row_bytes = args.tokens * 4
    batch_rows = max(1, int(args.batch_mb * 2**20) // row_bytes)
    rows = (args.rows // batch_rows) * batch_rows
    total = rows * row_bytes
    results = []

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.parquet")
        values = np.random.default_rng(0).integers(0, 50_000, rows * args.tokens, dtype=np.int32)
        pq.write_table(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(values), args.tokens)}),
                       path, row_group_size=batch_rows, compression="none")
        del values

        def parquet():
            pf = pq.ParquetFile(path)
            for batch in pf.iter_batches(batch_size=batch_rows):
                torch.from_numpy(token_matrix(batch.column(0), "tokens"))

        results.append(("Parquet file, read directly", _best(parquet, args.epochs)))

        local = LocalDataset(path, batch_rows, shuffle=False, loop=False)
        results.append(("LocalDataset (in process)", _best(lambda: sum(1 for _ in local), args.epochs)))

        node = subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", path, "--port", "0",
                                 "--batch-bytes", f"{int(args.batch_mb * 2**20)}"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            endpoint = node.stdout.readline().split()[-1]
            one = StreamingDataset([endpoint], global_batch_size=batch_rows, shuffle=False, loop=False, prefetch=4)
            results.append(("1 Flight node -> 1 client", _best(lambda: sum(1 for _ in one), args.epochs)))

            halves = [StreamingDataset([endpoint], global_batch_size=batch_rows, shuffle=False, loop=False,
                                       rank=r, world_size=2, prefetch=4) for r in range(2)]

            def two_clients():
                threads = [threading.Thread(target=lambda d=d: sum(1 for _ in d)) for d in halves]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            results.append(("1 Flight node -> 2 clients", _best(two_clients, args.epochs)))
        finally:
            node.terminate()
            node.wait(10)

        ceiling = tcp_ceiling(total, batch_rows * row_bytes, row_bytes, args.epochs)
        results.append(("raw loopback TCP (ceiling)", ceiling))

    print(f"\n{rows} rows of {args.tokens} int32 tokens ({total / 1e9:.2f} GB), batches of {batch_rows} rows "
          f"({batch_rows * row_bytes / 2**20:.1f} MiB), best of {args.epochs}, {os.cpu_count()} CPUs")
    print(f"{'source':<32}{'GB/s':>8}{'rows/s':>12}{'of TCP':>9}")
    for name, seconds in results:
        print(f"{name:<32}{total / seconds / 1e9:>8.2f}{rows / seconds:>12.0f}{ceiling / seconds:>9.0%}")


if __name__ == "__main__":
    main()
