"""No epoch hangs: real `python -m datacache serve` nodes over datasets of 1 to 50,000 rows, read whole by
StreamingDataset for generated batch sizes, column subsets, prefetch depths, reader threads and orders,
each under a hard timeout; a node sends each step once, even to a slow reader, and goes idle when its
clients close.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from datacache import CacheServer, DataCacheError, StreamingDataset
from datacache.dataset import _Stream
from tests.conftest import examples

# (rows, rows per Parquet row group, nodes): row groups smaller and larger than the batches drawn below.
DATASETS = [(1, 1, 1), (7, 3, 1), (203, 16, 3), (24_000, 3000, 1), (50_000, 128, 1)]
STEPS_AT_MOST = 300  # batch sizes are drawn so that an epoch has at most this many steps: the file stays fast


def write_rows(path, rows: int, row_group: int) -> str:
    """`id` int64 and `tokens` fixed_size_list<int32>[16], row i holding i everywhere."""
    ids = np.arange(rows, dtype=np.int64)
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids.astype(np.int32), 16)), 16)
    pq.write_table(pa.table({"id": ids, "tokens": tokens}), path, row_group_size=row_group)
    return str(path)


def start(source: str, shard: str = "0/1") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", "0",
                             "--shard", shard], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def endpoint(node: subprocess.Popen) -> str:
    """The node's endpoint, once it serves."""
    return node.stdout.readline().split()[-1]


def serve(source: str) -> tuple[subprocess.Popen, str]:
    """A real node process, and its endpoint once it serves."""
    node = start(source)
    return node, endpoint(node)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(nodes) -> None:
    for node in nodes:
        node.terminate()
    for node in nodes:
        node.wait(10)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """{rows: (source, endpoints)}: long-lived node processes for each dataset, shared by the module's tests."""
    tmp = tmp_path_factory.mktemp("rows")
    sources = {rows: write_rows(tmp / f"rows-{rows}.parquet", rows, group) for rows, group, _ in DATASETS}
    procs = {rows: [start(sources[rows], f"{i}/{n}") for i in range(n)] for rows, _, n in DATASETS}
    yield {rows: (sources[rows], [endpoint(p) for p in nodes]) for rows, nodes in procs.items()}
    stop([p for nodes in procs.values() for p in nodes])


@st.composite
def reads(draw):
    rows = draw(st.sampled_from([d[0] for d in DATASETS]))
    batch = draw(st.integers(-(-rows // STEPS_AT_MOST), rows))
    columns = draw(st.sampled_from([["id"], ["tokens"], ["tokens", "id"]]))
    prefetch, readers = draw(st.integers(0, 8)), draw(st.integers(1, 3))
    return rows, batch, columns, prefetch, readers, draw(st.booleans()), draw(st.booleans())


@pytest.mark.timeout(150)
@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=reads())
def test_every_epoch_ends_with_every_row_whatever_the_sizes(clusters, case):
    rows, batch, columns, prefetch, readers, shuffle, drop_last = case
    ds = StreamingDataset(clusters[rows][1], columns=columns, batch_size=batch, shuffle=shuffle, seed=7, loop=False,
                          drop_last=drop_last, prefetch=prefetch, readers=readers, timeout=10, retries=1)
    tic = time.monotonic()
    got = [b for b in ds]
    assert time.monotonic() - tic < 20
    steps = rows // batch if drop_last else -(-rows // batch)
    assert len(got) == steps and all(len(b[c]) == batch for b in got for c in columns)
    order = ds.plan.epoch_order(0)[:steps * batch]
    for c in columns:
        values = np.concatenate([b[c].numpy().reshape(batch, -1)[:, 0] for b in got])
        assert values.tolist() == order.tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch,shuffle", [(100, False), (128, False), (240, True), (1000, True)])
def test_the_reported_case_reads_three_epochs(clusters, batch, shuffle):
    # 24,000 rows in row groups of 3,000, ids only: it stalled after 200 of 240 batches of 100.
    ds = StreamingDataset(clusters[24_000][1], columns=["id"], batch_size=batch, shuffle=shuffle, seed=7,
                          loop=True)
    per_epoch = 24_000 // batch
    ids = []
    for b in StatefulDataLoader(ds, batch_size=None, num_workers=0):
        ids.append(b["id"])
        if len(ids) == 3 * per_epoch:
            break
    for epoch in range(3):
        seen = np.concatenate(ids[epoch * per_epoch:(epoch + 1) * per_epoch])
        assert seen.tolist() == ds.plan.epoch_order(epoch)[:per_epoch * batch].tolist()


class CountingNode(CacheServer):
    """A real node, in this process, that counts the steps it sends and the connections it is called on."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sent, self.calls, self.peers = 0, 0, set()
        threading.Thread(target=self.serve, daemon=True).start()

    def do_get(self, context, ticket):
        self.calls += 1
        self.peers.add(context.peer())
        return super().do_get(context, ticket)

    def _step_batches(self, steps, rows):
        for batch in super()._step_batches(steps, rows):
            self.sent += 1
            yield batch


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", [False, True])
def test_a_node_sends_each_step_once_to_a_slow_reader(tmp_path, loop):
    node = CountingNode(write_rows(tmp_path / "rows.parquet", 24_000, 3000))
    try:
        ds = StreamingDataset([node.location], columns=["id"], batch_size=100, shuffle=False, loop=loop, prefetch=8)
        consumed = 0
        for _ in ds:
            consumed += 1
            time.sleep(0.002)  # a training step: the reader is far ahead and waits for room
            if consumed == 240:
                break
    finally:
        node.shutdown()
    # Each step is sent once: what was consumed and at most a room of 8 more (it was ~2,000 sent for 240).
    assert consumed <= node.sent <= consumed + 8
    assert node.calls <= 1 + 240 // 4  # a call asks for at least half the room


@pytest.mark.timeout(60)
@pytest.mark.parametrize("readers", [1, 2])
def test_each_reader_has_its_own_connection_and_the_steps_come_in_plan_order(tmp_path, readers):
    node = CountingNode(write_rows(tmp_path / "rows.parquet", 24_000, 3000))
    try:
        ds = StreamingDataset([node.location], columns=["id"], batch_size=100, seed=5, loop=False, prefetch=8,
                              readers=readers)
        ids = np.concatenate([b["id"].numpy() for b in ds])
    finally:
        node.shutdown()
    assert ids.tolist() == ds.plan.epoch_order(0).tolist()  # 240 steps of 100 shuffled rows, each once
    assert len(node.peers) == readers and node.sent == 240


@pytest.mark.timeout(60)
def test_a_node_goes_idle_when_its_clients_close(clusters):
    node, endpoint = serve(clusters[24_000][0])  # a node of its own, so that no other test's client counts
    try:
        readers = [StreamingDataset([endpoint], columns=["id"], batch_size=100, shuffle=s, seed=1, prefetch=8)
                   for s in (False, True)]
        iterators = [iter(r) for r in readers]
        for _ in range(50):
            for it in iterators:
                next(it)
                time.sleep(0.001)
        for it in iterators:
            it.close()  # the clients stop here, mid-epoch, and keep their connections
        time.sleep(0.5)
        before = cpu_seconds(node.pid)
        time.sleep(5)
        assert cpu_seconds(node.pid) - before < 0.1
    finally:
        stop([node])



@pytest.mark.timeout(60)
def test_a_reader_stuck_where_no_deadline_reaches_fails_within_its_patience(clusters, monkeypatch):
    # Fault injection: the read-ahead thread blocks for good on its second call, past every gRPC deadline
    # (as it did in do_get in the reported hang). The consumer gives up after `patience`, naming the node.
    ds = StreamingDataset(clusters[24_000][1], columns=["id"], batch_size=100, shuffle=False, prefetch=2,
                          timeout=0.5, retries=1, backoff=0.01)
    opened, real_open = [], _Stream.open

    def open_once_then_block(self, client, columns):
        opened.append(1)
        if len(opened) > 1:
            threading.Event().wait()
        real_open(self, client, columns)

    monkeypatch.setattr(_Stream, "open", open_once_then_block)
    tic, got = time.monotonic(), 0
    with pytest.raises(DataCacheError, match=re.escape(f"no batch from the cache nodes {clusters[24_000][1][0]} in "
                                                       f"{ds.patience:.0f} s (timeout=0.5 s, retries=1)")):
        for _ in ds:
            got += 1
    assert got == 2 and time.monotonic() - tic < ds.patience + 2
