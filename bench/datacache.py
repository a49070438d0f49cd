"""Data throughput into torch tensors: Parquet read directly, the in-process LocalDataset, one cache node to
one client and to two clients, two nodes to two clients, against the raw loopback TCP ceiling; then small
batches (100 rows of 16 tokens) in rows/s. The nodes are `python -m datacache serve` processes with their
defaults: `StreamingDataset` reads their steps over their data plane (`datacache.wire`), Kubeflow's client
over Flight.

Rows are fixed-length lists of `--tokens` int32 ids (2 KB per row at 512). Every source is read in
batches of each size in `--batch-mb` (MiB; `--rows` rows in all, unshuffled) and each batch ends as a
torch tensor; the cache node holds record batches of that size too. The shuffled row reads the same rows
in `StreamingDataset`'s default order, a permutation of them, which the node gathers row by row. The
cache node and the TCP sender run in their own processes, as they would on a cluster; the TCP sender
holds as many bytes in memory as the node and sends them once a pass, batch by batch, and the receiver
reads each batch with `recv_into` straight into a fresh torch tensor (no copy after the socket: the least
any receiver can do). StreamingDataset reads with its defaults unless `--prefetch`/`--readers` say
otherwise, and every pass, TCP's too, runs under the malloc settings it sets in the process that reads
(`trainjob.allocator`). Every source gets one untimed pass first (an epoch of a long run, not its first). A
row's share of TCP ("of TCP") is against raw TCP passes run between its own passes, one before each ("TCP
GB/s", the best of them): on a shared machine the ceiling moves by a third from minute to minute, and a
ratio of two figures taken minutes apart would measure that. Beside throughput it prints the CPU time
each GB cost the reading process and the serving one: on a machine whose cores they share, that cost, not
the socket, bounds the throughput. The two-node row serves the rows as two shards, one node process each,
read by two clients in threads of this process, one from the start of the epoch and one from its middle
(`set_position`), half the epoch each: both nodes serve at once, each to one client; its serving CPU is
both nodes'.

Two rows read the same node through Kubeflow Trainer's cache protocol (`datacache.kubeflow`): Kubeflow's
own client (its `DataCacheDataset`: partition 0 of 1 from the node as head, each endpoint's IndexPair
ticket streamed whole), and `StreamingDataset` given the node as a Kubeflow head (`kubeflow+grpc://`: the
layout from the head, a call per step with an IndexPair ticket).

A small table reads `--small-rows` rows of an int64 `id` and 16 int32 tokens in batches of 100 rows (the
shape that once stalled an epoch): per-step costs, not bytes, bound it, so it is in rows/s.

The last table is a training job: `python -m trainer +runtime=torch-distributed` (one rank, a model whose
step takes milliseconds, and `--job-overrides`) reading its local corpus, then the same job with
`data.cache.nodes=2` (two cache nodes the run starts, the rank streaming from them), alternated
`--job-rounds` times; each run's tokens/s is the median of its metrics lines after the first (`--job-steps`
steps, a line every 10), and the row gives the median over the rounds and its ratio to the local corpus's.
`--batch-mb ''`, `--small-rows 0` and `--job-rounds 0` leave out those tables.

    python bench/datacache.py [--rows 400000] [--tokens 512] [--batch-mb 2,4,8,16] [--epochs 5] [--prefetch 32]
                              [--readers 2] [--small-rows 240000] [--job-steps 60] [--job-rounds 2]
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pyarrow.parquet as pq
import torch

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

from datacache import LocalDataset, StreamingDataset  # noqa: E402
from datacache.parquet import token_matrix  # noqa: E402
from trainjob.allocator import keep_freed_buffers  # noqa: E402
from trainjob.run_files import read_metrics  # noqa: E402


def _process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) another process has used so far; None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _best(fn, repeats: int, serving_pid: int | list[int] | None = None,
          paired: Callable[[], None] | None = None) -> tuple[float, float, float | None, float | None]:
    """Best wall time of `repeats` passes after one untimed pass (connections made, buffers allocated: an
    epoch of a long run, not the first); the mean CPU time per timed pass spent in this process (every
    thread) and in the serving processes (nodes or TCP sender), if any; and, given `paired`, the best wall
    time of a pass of it run before each pass of `fn` (its CPU time not counted)."""
    pids = [serving_pid] if isinstance(serving_pid, int) else serving_pid or []

    def serving() -> float | None:
        used = [_process_cpu(pid) for pid in pids]
        return None if not used or None in used else sum(used)

    fn()
    times, paired_times, here, there = [], [], 0.0, 0.0
    for _ in range(repeats):
        if paired is not None:
            tic = time.perf_counter()
            paired()
            paired_times.append(time.perf_counter() - tic)
        cpu, served, tic = time.process_time(), serving(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
        here += time.process_time() - cpu
        there = None if served is None or there is None else there + serving() - served
    return (min(times), here / repeats, None if there is None else there / repeats,
            min(paired_times) if paired_times else None)


def _tcp_sender(port: int, total: int, chunk: int, ready) -> None:
    data = memoryview(np.random.default_rng(0).integers(0, 2**31, total // 4, dtype=np.int32)).cast("B")
    with socket.create_server(("127.0.0.1", port)) as server:
        ready.set()
        while True:  # until terminated
            conn, _ = server.accept()
            with conn:
                for start in range(0, total, chunk):
                    conn.sendall(data[start:start + chunk])


class TcpCeiling:
    """A sender process holding `total` bytes, sending them whole to every connection `chunk` at a time;
    `receive()` reads them once, each chunk straight into a fresh torch tensor."""

    def __init__(self, total: int, chunk: int, row_bytes: int):
        self.total, self.chunk, self.row_bytes = total, chunk, row_bytes
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.sender = ctx.Process(target=_tcp_sender, args=(self.port, total, chunk, ready), daemon=True)
        self.sender.start()
        ready.wait(30)

    def receive(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port)) as conn:
            got = 0
            while got < self.total:
                rows = min(self.chunk, self.total - got) // self.row_bytes
                batch = torch.empty(rows, self.row_bytes // 4, dtype=torch.int32)
                view, n = memoryview(batch.numpy()).cast("B"), 0
                while n < len(view):
                    n += conn.recv_into(view[n:])
                got += len(view)

    def close(self) -> None:
        self.sender.terminate()
        self.sender.join(10)


def _one_node(path: str, batch_rows: int, row_bytes: int, reading: dict, best) -> list:
    """The rows of one node: to one client, shuffled, to two clients, to Kubeflow's client."""
    results = []
    node = _node(path, batch_rows * row_bytes)
    try:
        endpoint = node.stdout.readline().split()[-1]
        one = StreamingDataset([endpoint], global_batch_size=batch_rows, shuffle=False, loop=False,
                               **reading)
        results.append(("1 node -> 1 client", best(lambda: sum(1 for _ in one), node.pid)))
        shuffled = StreamingDataset([endpoint], global_batch_size=batch_rows, shuffle=True, loop=False,
                                    **reading)
        results.append(("  the same, shuffled", best(lambda: sum(1 for _ in shuffled), node.pid)))
        halves = [StreamingDataset([endpoint], global_batch_size=batch_rows, shuffle=False, loop=False,
                                   rank=r, world_size=2, **reading) for r in range(2)]
        results.append(("1 node -> 2 clients", best(lambda: _together(halves), node.pid)))
        results.append(("1 node -> Kubeflow's client", best(lambda: kubeflow_client(endpoint), node.pid)))
        as_head = StreamingDataset([f"kubeflow+{endpoint}"], global_batch_size=batch_rows, shuffle=False,
                                   **reading)
        results.append(("  StreamingDataset, kubeflow+", best(lambda: sum(1 for _ in as_head), node.pid)))
    finally:
        node.terminate()
        node.wait(10)
    return results


def measure(tmp: str, rows: int, tokens: int, batch_rows: int, epochs: int, reading: dict):
    """[(source, (seconds, CPU here, CPU serving, seconds of raw TCP between its passes))] for all rows at one
    batch size; the TCP ceiling last."""
    row_bytes = tokens * 4
    path = os.path.join(tmp, f"rows-{batch_rows}.parquet")
    values = np.random.default_rng(0).integers(0, 50_000, rows * tokens, dtype=np.int32)
    pq.write_table(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(values), tokens)}),
                   path, row_group_size=batch_rows, compression="none")
    del values
    results = []
    tcp = TcpCeiling(rows * row_bytes, batch_rows * row_bytes, row_bytes)

    def best(fn, serving_pid=None):
        return _best(fn, epochs, serving_pid, paired=tcp.receive)

    def parquet():
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=batch_rows):
            torch.from_numpy(token_matrix(batch.column(0), "tokens"))

    try:
        results.append(("Parquet file, read directly", best(parquet)))
        local = LocalDataset(path, global_batch_size=batch_rows, shuffle=False)
        results.append(("LocalDataset (in process)", best(lambda: sum(1 for _ in local))))

        results += _one_node(path, batch_rows, row_bytes, reading, best)
        nodes = [_node(path, batch_rows * row_bytes, f"{i}/2") for i in range(2)]
        try:
            endpoints = [n.stdout.readline().split()[-1] for n in nodes]
            pair = [StreamingDataset(endpoints, global_batch_size=batch_rows, shuffle=False, loop=False,
                                     **reading) for _ in range(2)]
            half = rows // batch_rows // 2
            pair[1].set_position(0, half)  # in node 1's shard, as pair[0] starts in node 0's
            results.append(("2 nodes -> 2 clients", best(lambda: _together(pair, half), [n.pid for n in nodes])))
        finally:
            for n in nodes:
                n.terminate()
                n.wait(10)
        seconds, cpu_read, cpu_serve, _ = _best(tcp.receive, epochs, tcp.sender.pid)
        results.append(("raw loopback TCP (ceiling)", (seconds, cpu_read, cpu_serve, seconds)))
    finally:
        tcp.close()
        os.remove(path)
    return results


def kubeflow_client(endpoint: str) -> None:
    """What Kubeflow's DataCacheDataset does in one process (world size 1, no workers): partition 0 of 1 from
    the head, then each endpoint's ticket from its location, every record batch a torch tensor."""
    info = flight.connect(endpoint).get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    for e in info.endpoints:
        for location in e.locations:
            for chunk in flight.FlightClient(location.uri).do_get(e.ticket):
                torch.from_numpy(token_matrix(chunk.data.column("tokens"), "tokens"))


def _node(path: str, batch_bytes: int, shard: str = "0/1") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", path, "--port", "0",
                             "--batch-bytes", str(batch_bytes), "--shard", shard], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _together(datasets, steps: int | None = None) -> None:
    """Reads each dataset to its end (or `steps` batches of it), all at once, a thread each."""
    threads = [threading.Thread(target=lambda d=d: sum(1 for _ in itertools.islice(d, steps))) for d in datasets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def small_batches(tmp: str, rows: int, epochs: int, reading: dict, batch_rows: int = 100) -> None:
    """Rows/s for batches of 100 rows of an int64 id and 16 int32 tokens (per-step costs, not bytes)."""
    path = os.path.join(tmp, "small.parquet")
    ids = np.arange(rows, dtype=np.int64)
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids.astype(np.int32), 16)), 16)
    pq.write_table(pa.table({"id": ids, "tokens": tokens}), path, row_group_size=3000)
    results = []

    def parquet():
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
            torch.from_numpy(token_matrix(batch.column(1), "tokens"))

    results.append(("Parquet file, read directly", _best(parquet, epochs)))
    local = LocalDataset(path, global_batch_size=batch_rows, shuffle=False)
    results.append(("LocalDataset (in process)", _best(lambda: sum(1 for _ in local), epochs)))
    node = _node(path, 8 << 20)
    try:
        endpoint = node.stdout.readline().split()[-1]
        for name, shuffle in (("1 node -> 1 client", False), ("  the same, shuffled", True)):
            ds = StreamingDataset([endpoint], columns=["id", "tokens"], batch_size=batch_rows, shuffle=shuffle,
                                  loop=False, **reading)
            results.append((name, _best(lambda d=ds: sum(1 for _ in d), epochs, node.pid)))
    finally:
        node.terminate()
        node.wait(10)
    print(f"\n{rows} rows of an int64 id and 16 int32 tokens in batches of {batch_rows} rows, best of {epochs}")
    print(f"{'source':<30}{'rows/s':>12}{'steps/s':>10}{'CPU read ms/1k steps':>22}{'CPU serve':>11}")
    steps = rows // batch_rows
    for name, (seconds, cpu_read, cpu_serve, _) in results:
        serve = "-" if cpu_serve is None else f"{cpu_serve / steps * 1e6:.1f}"
        print(f"{name:<30}{rows / seconds:>12.0f}{steps / seconds:>10.0f}{cpu_read / steps * 1e6:>22.1f}{serve:>11}",
              flush=True)


# A model whose step takes milliseconds, so that the data path's cost shows in tokens/s.
JOB = ["+runtime=torch-distributed", "runtime.nproc_per_node=1", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
       "model.n_kv_heads=2", "model.ffn_dim=128", "data.seq_len=128", "train.global_batch_size=16",
       "train.log_every=10", "train.progress=false", "train.resume=never"]


def _job_tokens_per_s(tmp: str, name: str, steps: int, overrides: list[str]) -> float:
    """The median tokens/s of a real run's metrics lines after its first."""
    run_dir = os.path.join(tmp, name)
    proc = subprocess.run([sys.executable, "-m", "trainer", *JOB, *overrides, f"train.max_steps={steps}",
                           f"train.eval_every={steps}", f"train.checkpoint_every={steps * 10}",
                           f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the job {' '.join(overrides)} failed:\n{proc.stderr[-2000:]}")
    rates = [m["tokens_per_s"] for m in read_metrics(run_dir) if "tokens_per_s" in m]
    if len(rates) < 2:
        raise SystemExit(f"--job-steps {steps} gives fewer than two metrics lines")
    return statistics.median(rates[1:])


def training_job(tmp: str, steps: int, rounds: int, overrides: list[str]) -> None:
    """tokens/s of a job reading its local corpus and of the same job streaming from 2 cache nodes."""
    runs = {"local corpus": [], "data.cache.nodes=2": []}
    for r in range(rounds):  # alternated: on a shared machine the load moves from minute to minute
        runs["local corpus"].append(_job_tokens_per_s(tmp, f"local-{r}", steps, overrides))
        runs["data.cache.nodes=2"].append(_job_tokens_per_s(tmp, f"nodes-{r}", steps,
                                                            [*overrides, "data.cache.nodes=2"]))
    base = statistics.median(runs["local corpus"])
    print(f"\ntraining job (the debug model at dim 64, 2 layers, {' '.join(JOB[7:9] + overrides)}, 1 rank): "
          f"tokens/s, median over {rounds} alternated runs of {steps} steps")
    print(f"{'data':<30}{'tokens/s':>12}{'of local':>10}   runs")
    for name, rates in runs.items():
        median = statistics.median(rates)
        print(f"{name:<30}{median:>12.0f}{median / base:>10.1%}   {', '.join(f'{x:.0f}' for x in rates)}", flush=True)


def main() -> None:
    # What a StreamingDataset sets in the process that iterates it, set before any pass: the TCP receiver
    # allocates its batches from the same heap, under the same rules.
    keep_freed_buffers()
    # Tensors over Arrow's read-only buffers, never written to here.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch-mb", default="2,4,8,16", help="batch sizes in MiB, comma-separated")
    parser.add_argument("--epochs", type=int, default=5, help="repeats; the best is reported")
    defaults = inspect.signature(StreamingDataset).parameters
    parser.add_argument("--prefetch", type=int, default=defaults["prefetch"].default,
                        help="StreamingDataset's steps read ahead (default: its default)")
    parser.add_argument("--readers", type=int, default=defaults["readers"].default,
                        help="StreamingDataset's read-ahead threads (default: its default)")
    parser.add_argument("--small-rows", type=int, default=240_000, help="rows for the 100-row batch table")
    parser.add_argument("--job-steps", type=int, default=60, help="steps of each training job run (0: no job table)")
    parser.add_argument("--job-rounds", type=int, default=2, help="alternated runs of each job")
    parser.add_argument("--job-overrides", default="", help="more overrides for the jobs, space-separated")
    args = parser.parse_args()
    row_bytes = args.tokens * 4
    reading = {"prefetch": args.prefetch, "readers": args.readers}
    print(f"{args.rows} rows of {args.tokens} int32 tokens (~{args.rows * row_bytes / 1e9:.2f} GB) into torch "
          f"tensors, best of {args.epochs}, {os.cpu_count()} CPUs")
    print("CPU: seconds of CPU time per GB delivered (mean over the passes), in the reading process (all its "
          "threads) and in the serving one (cache node or TCP sender)")
    print(f"{'batch':>8}  {'source':<30}{'GB/s':>8}{'rows/s':>12}{'of TCP':>9}{'TCP GB/s':>9}{'CPU read':>10}"
          f"{'CPU serve':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for mb in (float(x) for x in args.batch_mb.split(",") if x):  # --batch-mb '': no byte table
            batch_rows = max(1, int(mb * 2**20) // row_bytes)
            rows = (args.rows // batch_rows) * batch_rows
            gb = rows * row_bytes / 1e9
            results = measure(tmp, rows, args.tokens, batch_rows, args.epochs, reading)
            for name, (seconds, cpu_read, cpu_serve, tcp_seconds) in results:
                serve = "-" if cpu_serve is None else f"{cpu_serve / gb:.2f}"
                print(f"{batch_rows * row_bytes / 2**20:>5.1f}MiB  {name:<30}{gb / seconds:>8.2f}"
                      f"{rows / seconds:>12.0f}{tcp_seconds / seconds:>9.0%}{gb / tcp_seconds:>9.2f}"
                      f"{cpu_read / gb:>10.2f}{serve:>11}", flush=True)
        if args.small_rows:
            small_batches(tmp, args.small_rows, args.epochs, reading)
        if args.job_steps and args.job_rounds:
            training_job(tmp, args.job_steps, args.job_rounds, args.job_overrides.split())


if __name__ == "__main__":
    main()
