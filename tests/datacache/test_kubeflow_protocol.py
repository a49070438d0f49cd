"""Our cache node speaks Kubeflow Trainer's cache protocol (`datacache.kubeflow`): Kubeflow's client in real
torchrun ranks (gloo) reads every row exactly once per epoch from one node and from two, with 0 and 2
DataLoader workers; partitions, IndexPair tickets, one location per endpoint at the advertised address,
peers, `GET /ready`, and a token that refuses Kubeflow's client saying why. Real nodes (`python -m datacache
serve` processes, or CacheServer threads) on loopback.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datacache import CacheServer, DataCacheError
from datacache import kubeflow as kf
from tests.conftest import REPO, examples

ROWS = 10_000


def _write(path, rows: int = ROWS) -> str:
    ids = np.arange(rows, dtype=np.int64)
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids.astype(np.int32), 8)), 8)
    pq.write_table(pa.table({"id": ids, "quality": (ids % 10) / 10, "tokens": tokens}), path, row_group_size=700)
    return str(path)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("kubeflow") / "rows.parquet")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _nodes(source: str, count: int, *extra: str) -> tuple[list[subprocess.Popen], list[str]]:
    """`count` real node processes, shard i of count each, every one given all as --peers; their endpoints."""
    ports = _free_ports(count)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = [subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", str(p),
                               "--shard", f"{i}/{count}", "--peers", peers, "--batch-bytes", "64KiB", *extra],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, p in enumerate(ports)]
    return procs, [p.stdout.readline().split()[-1] for p in procs]


def _stop(procs) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(10)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("count", [1, 2])
def test_kubeflows_client_in_torchrun_ranks_reads_every_row_once_per_epoch(source, tmp_path, count):
    procs, endpoints = _nodes(source, count)
    try:
        head = endpoints[-1].replace("grpc+tcp://", "grpc://")  # any node answers for the whole table
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-port", str(_free_ports(1)[0]),
                              os.path.join(REPO, "tests", "datacache", "kubeflow_client.py"), head, str(tmp_path), "2"],
                             cwd=REPO, capture_output=True, text=True, timeout=200)
    finally:
        _stop(procs)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert set(ranks[0]) == {"0/0", "0/1", "2/0", "2/1"}
    for key in ranks[0]:
        seen = collections.Counter(i for rank in ranks for i in rank[key])
        assert sorted(seen) == list(range(ROWS)) and set(seen.values()) == {1}, key
    assert ranks[0]["0/0"] != ranks[0]["0/1"]  # set_epoch moved the partitions: another share this epoch


@pytest.fixture(scope="module")
def two(source):
    servers = [CacheServer(source, shard=i, num_shards=2, batch_bytes=1 << 14, advertise=f"node-{i}.cache:5005{i}",
                           peers=["node-0.cache:50050", "node-1.cache:50051"]) for i in range(2)]
    for s in servers:
        threading.Thread(target=s.serve, daemon=True).start()
    yield servers
    for s in servers:
        s.shutdown()


@settings(max_examples=examples(40), deadline=None)
@given(total=st.integers(1, 300), data=st.data())
def test_a_partition_is_kubeflows_with_an_endpoint_per_node_holding_part(two, total, data):
    index = data.draw(st.integers(0, total - 1))
    client = flight.FlightClient(f"grpc://127.0.0.1:{two[1].port}")
    k = -(-ROWS // total)
    start, stop = index * k, min((index + 1) * k, ROWS)
    if start >= stop:
        with pytest.raises(flight.FlightServerError, match=f"out of range: partition {index} of {total}"):
            client.get_flight_info(flight.FlightDescriptor.for_path(str(index), str(total)))
        return
    info = client.get_flight_info(flight.FlightDescriptor.for_path(str(index), str(total)))
    assert info.total_records == stop - start and info.schema == two[0].rows.schema
    pairs = []
    for endpoint in info.endpoints:
        assert len(endpoint.locations) == 1
        a, b = kf.decode_index_pair(endpoint.ticket.ticket)
        node = 0 if b < ROWS // 2 else 1
        assert endpoint.locations[0].uri.decode() == f"grpc+tcp://node-{node}.cache:5005{node}"  # advertised
        assert endpoint.app_metadata == endpoint.ticket.ticket
        pairs.append((a, b))
    assert pairs[0][0] == start and pairs[-1][1] == stop - 1
    assert all(pairs[i][1] + 1 == pairs[i + 1][0] for i in range(len(pairs) - 1))
    assert len(pairs) == len({0 if a < ROWS // 2 else 1 for a, _ in pairs} | {0 if b < ROWS // 2 else 1
                                                                               for _, b in pairs})


@settings(max_examples=examples(30), deadline=None)
@given(start=st.integers(0, ROWS + 100), length=st.integers(1, 3000))
def test_an_index_pair_ticket_streams_the_rows_a_node_holds_in_the_tables_schema(two, start, length):
    end = start + length - 1
    if start >= ROWS:  # no row of the table: refused in one line by every node
        for node in two:
            with pytest.raises(flight.FlightServerError, match=f"out of range: IndexPair \\[{start}, {end}\\] starts "
                               f"past the table's {ROWS} rows"):
                flight.FlightClient(f"grpc://127.0.0.1:{node.port}").do_get(
                    flight.Ticket(kf.encode_index_pair(start, end))).read_all()
        return
    got = []
    for node in two:
        table = flight.FlightClient(f"grpc://127.0.0.1:{node.port}").do_get(
            flight.Ticket(kf.encode_index_pair(start, end))).read_all()
        assert table.schema == node.rows.schema
        got += table.column("id").to_pylist()
    assert got == list(range(start, min(end + 1, ROWS)))


@pytest.mark.timeout(60)
def test_tickets_and_partitions_out_of_range_are_refused_in_one_line_and_the_node_serves_on(two):
    client = flight.FlightClient(f"grpc://127.0.0.1:{two[0].port}")
    cases = [(kf.encode_index_pair(50, 10), r"IndexPair \[50, 10\] ends before it starts"),
             (kf.encode_index_pair(1 << 63, (1 << 64) - 1), f"starts past the table's {ROWS} rows"),
             (b"\xff" * 17, "not a datacache ticket")]
    for ticket, message in cases:
        with pytest.raises(flight.FlightServerError, match=message):
            client.do_get(flight.Ticket(ticket)).read_all()
    for index, total in [("5", "2"), ("0", "0"), ("99999999999999999999999", "1")]:
        with pytest.raises(flight.FlightServerError, match=f"out of range: partition {index} of {total}"):
            client.get_flight_info(flight.FlightDescriptor.for_path(index, total))
    for index, total in [("-1", "2"), ("1", "-3"), ("x", "2")]:
        with pytest.raises(pa.ArrowInvalid, match="give \\[index, total\\] as two integers"):
            client.get_flight_info(flight.FlightDescriptor.for_path(index, total))
    assert client.do_get(flight.Ticket(kf.encode_index_pair(0, 9))).read_all().column("id").to_pylist() == list(
        range(10))


def test_index_pair_encoding_is_bincode_standard():
    assert kf.encode_index_pair(0, 4999) == bytes.fromhex("00fb8713")
    assert kf.encode_index_pair(250, 251) == bytes.fromhex("fa fb fb00")
    assert kf.encode_index_pair(1 << 16, (1 << 32) + 1) == bytes.fromhex("fc 00000100 fd 0100000001000000")
    for pair in [(0, 0), (7, 65535), (65536, 1 << 40)]:
        assert kf.decode_index_pair(kf.encode_index_pair(*pair)) == pair
    with pytest.raises(ValueError, match="bytes after the pair"):
        kf.decode_index_pair(bytes.fromhex("000000"))
    assert kf.partition(100, 3, 4) == (75, 99) and kf.partition(3, 3, 8) is None and kf.partition(10, 2, 3) == (8, 9)


def test_a_path_that_is_not_two_integers_is_invalid_and_our_descriptor_still_works(two):
    client = flight.FlightClient(f"grpc://127.0.0.1:{two[0].port}")
    with pytest.raises(pa.ArrowInvalid, match=r"path \['a', '2'\]: give \[index, total\] as two integers"):
        client.get_flight_info(flight.FlightDescriptor.for_path("a", "2"))
    ours = json.loads(client.get_flight_info(flight.FlightDescriptor.for_path("dataset")).app_metadata)
    assert ours["offset"] == 0 and ours["rows"] == ROWS // 2 and ours["total_rows"] == ROWS


def test_a_shard_without_peers_refuses_to_answer_for_the_whole_table(source):
    node = CacheServer(source, shard=1, num_shards=2)
    threading.Thread(target=node.serve, daemon=True).start()
    try:
        with pytest.raises(flight.FlightServerError, match="holds shard 1/2 only and knows no peers: start every "
                                                           "node with --peers"):
            flight.FlightClient(node.location).get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    finally:
        node.shutdown()
    with pytest.raises(DataCacheError, match="--peers: 1 addresses for 2 shards"):
        CacheServer(source, shard=0, num_shards=2, peers=["a:1"])
    with pytest.raises(DataCacheError, match="--advertise 'nohost': give host:port"):
        CacheServer(source, advertise="nohost")


def test_nodes_on_port_0_learn_their_peers_once_up(source):
    nodes = [CacheServer(source, shard=i, num_shards=2) for i in range(2)]
    for node in nodes:
        threading.Thread(target=node.serve, daemon=True).start()
    try:
        for node in nodes:
            node.set_peers([n.location for n in nodes])  # Flight locations or host:port
        info = flight.FlightClient(nodes[0].location).get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
        assert [e.locations[0].uri.decode() for e in info.endpoints] == [n.location for n in nodes]
        assert [kf.decode_index_pair(e.ticket.ticket) for e in info.endpoints] == [(0, 4999), (5000, 9999)]
    finally:
        for node in nodes:
            node.shutdown()


def test_a_node_with_a_token_refuses_kubeflows_client_saying_why(source):
    node = CacheServer(source, token="s3cret")
    threading.Thread(target=node.serve, daemon=True).start()
    try:
        with pytest.raises(flight.FlightUnauthenticatedError, match="started with a token and the call carried none "
                                                                   ".*Kubeflow Trainer's DataCacheDataset sends none"):
            flight.connect(node.location).get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    finally:
        node.shutdown()


@pytest.mark.timeout(60)
def test_ready_on_the_health_port_and_advertise_from_the_command_line(source):
    port, health = _free_ports(2)
    node = subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", str(port),
                             "--advertise", f"cache-0.cache:{port}", "--health-port", str(health)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert node.stdout.readline().split()[-1] == f"grpc+tcp://cache-0.cache:{port}"
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/ready", timeout=5) as answer:
            assert answer.status == 200 and answer.read() == b"ready"
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{health}/other", timeout=5)
    finally:
        _stop([node])


@settings(max_examples=examples(60), deadline=None)
@given(rows=st.integers(1, 5000), data=st.data())
def test_the_layout_is_found_from_partition_holders_alone(rows, data):
    # Runs of rows on workers, a worker holding several runs (as Kubeflow deals files out round robin).
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, rows - 1)), max_size=min(12, rows - 1))))
    bounds = [0, *cuts, rows]
    owners = [data.draw(st.sampled_from("abc")) for _ in bounds[1:]]
    owner_of = np.repeat(owners, np.diff(bounds))
    calls = []

    def holders(index, total):  # what the head answers: the workers holding part of the partition, in order
        start, end = kf.partition(rows, index, total)
        calls.append((index, total))
        return list(dict.fromkeys(owner_of[start:end + 1]))

    runs = kf.find_runs(rows, holders)
    assert np.array_equal(np.repeat([w for _, _, w in runs], [b - a for a, b, _ in runs]), owner_of)
    assert all(runs[i][1] == runs[i + 1][0] and runs[i][2] != runs[i + 1][2] for i in range(len(runs) - 1))
    assert len(calls) <= 1 + 4 * len(bounds) * max(1, rows).bit_length()  # a few calls a boundary, not a row
