"""The Arrow Flight cache: real Flight servers on loopback, real DataLoader worker processes.

Every row is delivered exactly once per epoch for any world size, worker count, batch, shuffle and node
count, and every rank gets the same number of batches; resumption continues with exactly the rest; a
dead node, a wrong token, a corrupt file or mismatched nodes are clear errors, and nothing hangs.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from datacache import CacheServer, DataCacheError, LocalDataset, StreamingDataset
from datacache.dataset import _Stream, _to_tensor
from datacache.server import decode_ticket, encode_ticket
from tests.conftest import REPO, examples

ROWS = 203  # prime: no batch size divides it


# DataLoader workers that stream start from a fork server (gRPC does not survive fork); it imports torch once
# for all of them, where each worker would otherwise import it again (seconds apiece).
multiprocessing.set_forkserver_preload(["torch"])


def _write(path, rows=ROWS, width=4, dtype=np.int32, extra=None):
    ids = np.repeat(np.arange(rows, dtype=dtype), width)  # row i holds the value i
    columns = {"tokens": pa.FixedSizeListArray.from_arrays(pa.array(ids), width)}
    columns.update(extra or {})
    pq.write_table(pa.table(columns), path)
    return str(path)


def _serve(source, shards=1, **kw):
    servers = [CacheServer(source, shard=i, num_shards=shards, batch_bytes=256, **kw) for i in range(shards)]
    for s in servers:
        threading.Thread(target=s.serve, daemon=True).start()
    return servers


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("data") / "rows.parquet")


@pytest.fixture(scope="module")
def nodes(source):
    one, three = _serve(source, 1), _serve(source, 3)
    yield {1: [s.location for s in one], 3: [s.location for s in three]}
    for s in one + three:
        s.shutdown()


def _dataset(kind, source, nodes, **kw):
    if kind == "local":
        return LocalDataset(source, **kw)
    return StreamingDataset(nodes[int(kind[0])], retries=1, timeout=10, **kw)


def _epoch(kind, source, nodes, world, workers, global_batch, shuffle, drop_last=True, start=0):
    per_rank = []
    for rank in range(world):
        ds = _dataset(kind, source, nodes, global_batch_size=global_batch, shuffle=shuffle, seed=3, loop=False,
                      rank=rank, world_size=world, drop_last=drop_last)
        ds.set_position(0, start)
        # gRPC does not survive fork: streaming workers start from a fork server.
        context = "forkserver" if workers and kind != "local" else None
        loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=context,
                            timeout=60 if workers else 0)
        per_rank.append([b["tokens"][:, 0].tolist() for b in loader])
    return per_rank


@pytest.mark.timeout(120)
@settings(max_examples=examples(5), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["local", "1-node", "3-node"]), world=st.integers(1, 4), workers=st.integers(0, 2),
       per_rank=st.integers(1, 9), shuffle=st.booleans(), drop_last=st.booleans())
def test_every_row_once_per_epoch_and_equal_batches(source, nodes, kind, world, workers, per_rank, shuffle,
                                                    drop_last):
    global_batch = per_rank * world
    ranks = _epoch(kind, source, nodes, world, workers, global_batch, shuffle, drop_last)
    assert len({len(batches) for batches in ranks}) == 1  # a rank with fewer batches would hang DDP
    seen = collections.Counter(row for batches in ranks for batch in batches for row in batch)
    assert all(len(batch) == per_rank for batches in ranks for batch in batches)
    full = (ROWS // global_batch) * global_batch
    if drop_last:
        assert sum(seen.values()) == full and max(seen.values()) == 1
    else:
        assert set(seen) == set(range(ROWS))  # every row, the last batch padded from the epoch's start
        assert sum(seen.values()) == -(-ROWS // global_batch) * global_batch


def test_global_batches_do_not_depend_on_world_size_workers_or_nodes(source, nodes):
    for shuffle in (False, True):  # and the cache gives the batches LocalDataset gives
        assert _epoch("3-node", source, nodes, 1, 0, 10, shuffle) == _epoch("local", source, nodes, 1, 0, 10, shuffle)
    for kind in ("1-node", "3-node"):
        a = _epoch(kind, source, nodes, 1, 0, 10, True)[0]
        b = _epoch(kind, source, nodes, 2, 2, 10, True)
        assert [x + y for x, y in zip(*b, strict=True)] == a


def test_shuffle_is_deterministic_and_changes_per_epoch(nodes):
    a = StreamingDataset(nodes[3], global_batch_size=10, seed=5)
    b = StreamingDataset(nodes[1], global_batch_size=10, seed=5)
    assert np.array_equal(a.plan.epoch_order(0), b.plan.epoch_order(0))
    assert not np.array_equal(a.plan.epoch_order(0), a.plan.epoch_order(1))
    assert not np.array_equal(a.plan.epoch_order(0), np.arange(ROWS))


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_mid_epoch_exactly(nodes, workers):
    def loader(state=None):
        ds = StreamingDataset(nodes[3], global_batch_size=8, seed=1, loop=False)
        dl = StatefulDataLoader(ds, batch_size=None, num_workers=workers,
                                multiprocessing_context="forkserver" if workers else None)
        if state is not None:
            dl.load_state_dict(state)
        return dl

    first = loader()
    it, consumed = iter(first), []
    for _ in range(7):
        consumed += next(it)["tokens"][:, 0].tolist()
    state = first.state_dict()
    rest = [row for b in loader(state) for row in b["tokens"][:, 0].tolist()]
    assert sorted(consumed + rest) == sorted(set(consumed + rest))
    assert len(consumed + rest) == (ROWS // 8) * 8


def test_rank_level_position_resumes_with_other_workers_and_world_size(source, nodes):
    whole = [row for batches in _epoch("3-node", source, nodes, 1, 0, 12, True) for b in batches for row in b]
    # 5 global batches were consumed by 2 ranks with 1 worker each; 3 ranks x 3 workers finish the epoch.
    done = [row for batches in _epoch("3-node", source, nodes, 2, 1, 12, True) for b in batches[:5] for row in b]
    rest = [row for batches in _epoch("3-node", source, nodes, 3, 3, 12, True, start=5) for b in batches for row in b]
    assert sorted(done + rest) == sorted(whole) and len(set(done + rest)) == len(whole)


def test_one_node_contiguous_batch_is_zero_copy(nodes):
    ds = StreamingDataset(nodes[1], global_batch_size=8, shuffle=False, loop=False)
    batch = ds._read(_Stream(ds._nodes[0], [np.array([[0, 8]])]))
    tensor = _to_tensor(batch.column("tokens"))
    values = batch.column("tokens").values
    assert tensor.data_ptr() == values.buffers()[1].address + values.offset * values.type.byte_width
    assert tensor[:, 0].tolist() == list(range(8))


class _Node(CacheServer):
    """A real node that counts its streams and can break the first one after two steps (as a stream does when
    its node restarts) or take `delay` seconds a step (a slow node)."""

    def __init__(self, *args, break_once=False, delay=0.0, **kw):
        super().__init__(*args, **kw)
        self.streams, self.broke, self.break_once, self.delay = 0, False, break_once, delay
        self.tickets = []  # each call's steps
        threading.Thread(target=self.serve, daemon=True).start()

    def do_get(self, context, ticket):
        self.streams += 1
        self.tickets.append([r.tolist() for r in decode_ticket(ticket.ticket)[0]])
        return super().do_get(context, ticket)

    def _step_batches(self, steps, rows):
        for i, batch in enumerate(super()._step_batches(steps, rows)):
            if self.break_once and i == 2 and not self.broke:
                self.broke = len(self.tickets)  # the call that broke
                raise flight.FlightUnavailableError("restarting")
            time.sleep(self.delay)
            yield batch


def _rows(ds):
    return [row for batch in ds for row in batch["tokens"][:, 0].tolist()]


@pytest.mark.timeout(60)
def test_a_broken_stream_resumes_at_the_first_step_it_had_not_delivered(source):
    node = _Node(source, batch_bytes=256, break_once=True)
    try:
        ds = StreamingDataset([node.location], global_batch_size=8, seed=2, loop=False, backoff=0.01, prefetch=6)
        rows = _rows(ds)
    finally:
        node.shutdown()
    broken = node.tickets[node.broke - 1]
    assert node.tickets[node.broke] == broken[2:]  # the next call asks again for what was not delivered
    assert rows == [int(r) for r in ds.plan.epoch_order(0)[:(ROWS // 8) * 8]]


@pytest.mark.timeout(60)
def test_a_stream_past_its_deadline_goes_on_without_counting_as_a_failure(source):
    node = _Node(source, batch_bytes=256, delay=0.06)
    try:
        # 25 steps of 60 ms under a 0.5 s call deadline: several streams, and no retries to spend. (A stream that
        # delivers nothing before its deadline is a failure: on a loaded machine a 0.15 s deadline met that.)
        ds = StreamingDataset([node.location], global_batch_size=8, seed=2, loop=False, timeout=0.5, retries=0)
        rows = _rows(ds)
    finally:
        node.shutdown()
    assert node.streams >= 3
    assert rows == [int(r) for r in ds.plan.epoch_order(0)[:(ROWS // 8) * 8]]


@pytest.mark.timeout(60)
def test_a_slow_consumer_costs_a_call_per_half_room_not_per_step(source):
    node = _Node(source, batch_bytes=256)
    try:
        ds = StreamingDataset([node.location], global_batch_size=8, seed=2, loop=False, prefetch=6)
        rows = []
        for batch in ds:
            rows += batch["tokens"][:, 0].tolist()
            time.sleep(0.01)  # the fetcher is far ahead: its room of 6 steps fills, and it waits
    finally:
        node.shutdown()
    # The first call fills the room of 6; the stream closes, and reopens once 3 are left, for 3 steps or
    # more a call: at most 1 + ceil((25 - 6) / 3) calls (a call per step would be ~19).
    assert 3 <= node.streams <= 1 + -(-(25 - 6) // 3)
    assert rows == [int(r) for r in ds.plan.epoch_order(0)[:(ROWS // 8) * 8]]


@pytest.mark.timeout(60)
def test_a_paused_consumer_holds_no_stream_open(tmp_path):
    # 32 MB, more than gRPC buffers: a stream left open would keep the node's sender waiting on the client.
    node = _Node(_write(tmp_path / "wide.parquet", rows=512, width=16384), batch_bytes=1 << 20)
    ds = StreamingDataset([node.location], global_batch_size=8, seed=2, loop=False, prefetch=2)
    it = iter(ds)
    first = [next(it)["tokens"][:, 0].tolist() for _ in range(3)]
    time.sleep(0.2)  # the fetcher fills its room of 2 steps and closes the stream
    stopper = threading.Thread(target=node.shutdown)
    stopper.start()
    stopper.join(10)  # a node's shutdown waits for open streams
    assert not stopper.is_alive()
    assert first == np.asarray(ds.plan.epoch_order(0)[:24]).reshape(3, 8).tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [0, 4])
def test_a_node_that_dies_mid_stream_is_a_clear_error(source, prefetch):
    servers = _serve(source, 2)
    ds = StreamingDataset([s.location for s in servers], global_batch_size=8, shuffle=False, retries=2,
                          backoff=0.05, timeout=5, prefetch=prefetch)
    it = iter(ds)
    next(it)
    servers[1].shutdown()
    with pytest.raises(DataCacheError, match=re.escape(f"cache node {servers[1].location}: do_get failed 3 times")):
        for _ in range(ROWS):
            next(it)
    servers[0].shutdown()


@pytest.mark.timeout(60)
def test_a_node_replaced_by_one_with_other_rows_is_refused_in_one_line(source, tmp_path):
    first = _serve(source)[0]
    ds = StreamingDataset([first.location], global_batch_size=8, loop=False, retries=3, backoff=0.01, prefetch=2)
    ds.describe()
    port = first.port
    first.shutdown()
    fewer = _write(tmp_path / "fewer.parquet", rows=17)
    second = CacheServer(fewer, location=f"grpc://127.0.0.1:{port}", batch_bytes=256)
    threading.Thread(target=second.serve, daemon=True).start()
    try:
        with pytest.raises(DataCacheError) as e:
            list(ds)
    finally:
        second.shutdown()
    message = str(e.value)
    assert message.startswith(f"cache node {first.location} refused do_get: rows [")
    assert "are not on this node, which holds [0, 17)" in message
    assert "gRPC" not in message and "\n" not in message


@pytest.mark.timeout(60)
def test_unreachable_node_wrong_token_and_mismatched_nodes(source, tmp_path):
    with pytest.raises(DataCacheError, match="cache node grpc://127.0.0.1:9: get_flight_info failed 2 times"):
        StreamingDataset(["grpc://127.0.0.1:9"], global_batch_size=8, retries=1, backoff=0.01, timeout=2).describe()

    secured = _serve(source, 1, token="s3cret")[0]
    with pytest.raises(DataCacheError, match="refused this client: a wrong or missing token"):
        StreamingDataset([secured.location], global_batch_size=8, token="wrong").describe()
    with pytest.raises(DataCacheError, match="refused this client"):
        next(iter(StreamingDataset([secured.location], global_batch_size=8)))
    ok = StreamingDataset([secured.location], global_batch_size=8, token="s3cret", loop=False)
    assert sum(1 for _ in ok) == ROWS // 8
    secured.shutdown()

    other = _write(tmp_path / "other.parquet", width=4, dtype=np.int64)
    a, b = _serve(source, 2)[0], _serve(other, 2)[1]
    with pytest.raises(DataCacheError, match="serves schema"):
        StreamingDataset([a.location, b.location], global_batch_size=8).describe()
    with pytest.raises(DataCacheError, match="a shard is missing from the endpoints"):
        StreamingDataset([a.location], global_batch_size=8).plan  # noqa: B018 - reading it asks the nodes
    a.shutdown()
    b.shutdown()


def test_a_plain_flight_client_reads_a_node_and_bad_tickets_are_refused(nodes):
    client = flight.FlightClient(nodes[3][1])
    info = client.get_flight_info(flight.FlightDescriptor.for_path("dataset"))
    table = client.do_get(info.endpoints[0].ticket).read_all()
    lo, hi = ROWS // 3, 2 * ROWS // 3
    assert table.column("tokens").combine_chunks().values.to_numpy()[::4].tolist() == list(range(lo, hi))
    batch_rows = json.loads(info.app_metadata)["batch_rows"]
    assert table.num_rows == info.total_records and 8 <= batch_rows <= 16  # batches of about 256 bytes
    assert [len(c) for c in table.column("tokens").chunks] == [batch_rows] * (table.num_rows // batch_rows) + (
        [table.num_rows % batch_rows] if table.num_rows % batch_rows else [])

    def refused(ticket):
        with pytest.raises(flight.FlightServerError) as e:
            client.do_get(flight.Ticket(ticket)).read_all()
        return str(e.value)

    assert "not a datacache ticket" in refused(b'{"ranges": [[0, 8]]}')
    assert f"rows [0, 8) are not on this node, which holds [{lo}, {hi})" in refused(encode_ticket([np.array([[0, 8]])]))
    assert "no column text here (there are tokens)" in refused(encode_ticket([np.array([[lo, lo + 1]])], ["text"]))


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "datacache", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_cache_node_never_imports_torch():
    """`python -m datacache serve` and every `ready` probe start without torch's seconds of import."""
    probe = ("import sys, runpy; sys.argv = ['datacache', '--help']\n"
             "try:\n    runpy.run_module('datacache', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "import datacache.server\nfrom datacache import CacheServer, DataCacheError\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.timeout(120)
def test_cli_serve_stat_ready_and_a_corrupt_file(tmp_path, source):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet PAR1")
    proc = _cli("serve", "--source", str(tmp_path / "*.parquet"), "--port", "0")
    assert proc.returncode == 2 and f"{bad}: not a readable Parquet file" in proc.stderr
    proc = _cli("serve", "--source", source, "--port", "0", "--filter", "__import__('os')")
    assert proc.returncode == 2 and "--filter" in proc.stderr

    os.makedirs(tmp_path / "f")
    filtered = _write(tmp_path / "f" / "rows.parquet",
                      extra={"split": pa.array(["train" if i % 4 else "eval" for i in range(ROWS)])})
    server = subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", filtered, "--port", "0",
                               "--filter", "split == 'train'", "--columns", "tokens"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        endpoint = server.stdout.readline().split()[-1]
        assert _cli("ready", endpoint).returncode == 0
        stat = _cli("stat", endpoint)
        assert stat.returncode == 0 and '"rows": 152' in stat.stdout and "split" not in stat.stdout
        rows = [r for b in StreamingDataset([endpoint], global_batch_size=8, shuffle=False, loop=False)
                for r in b["tokens"][:, 0].tolist()]
        assert all(r % 4 for r in rows) and len(rows) == 152
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert _cli("ready", endpoint).returncode == 1


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_batches_are_tensors_of_the_stored_type_from_several_nodes(tmp_path, dtype):
    path = _write(tmp_path / "rows.parquet", dtype=dtype)
    servers = _serve(path, 3)
    try:
        batch = next(iter(StreamingDataset([s.location for s in servers], global_batch_size=40, shuffle=True)))
    finally:
        for s in servers:
            s.shutdown()
    stored = torch.from_numpy(np.zeros(1, dtype)).dtype
    assert batch["tokens"].dtype == stored and batch["tokens"].shape == (40, 4)
    rows = batch["tokens"].long()
    assert torch.equal(rows, rows[:, :1].expand(40, 4)) and len(set(rows[:, 0].tolist())) == 40
    local = next(iter(LocalDataset(path, global_batch_size=40, shuffle=True)))["tokens"]  # the same batch, type
    assert local.dtype == stored and torch.equal(local.long(), rows)
