"""The data plane (`datacache.wire`): real nodes on loopback serving steps as Arrow IPC over a plain socket.

A client reads the same batches over it as over Flight, every row once, shuffled or not; the node's checks,
its token, its failures while sending and a stream broken mid-way reach the client as they do over Flight;
a data port the client cannot reach, and a node under TLS, leave it on Flight.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pyarrow.parquet as pq
import pytest

from datacache import CacheServer, DataCacheError, StreamingDataset, wire
from datacache.dataset import _DataPlane, _has_dictionary
from datacache.server import encode_ticket
from datacache.wire import Unreachable, WireReader, WireServer, _body_length
from tests.conftest import REPO

ROWS = 1009  # prime: no batch size divides it


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("wire") / "rows.parquet"
    ids = np.arange(ROWS, dtype=np.int64)
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids.astype(np.int32), 8)), 8)
    pq.write_table(pa.table({"id": ids, "tokens": tokens, "text": [f"row {i}" for i in ids]}), path)
    return str(path)


def _serve(node: CacheServer) -> CacheServer:
    threading.Thread(target=node.serve, daemon=True).start()
    return node


def _epoch(node: CacheServer, **kw) -> list[dict]:
    ds = StreamingDataset([node.location], columns=["id", "tokens"], batch_size=32, seed=3, backoff=0.01, **kw)
    return list(ds)


def _every_row_once(batches: list[dict]) -> np.ndarray:
    """The epoch's row ids, in order, checked to be every row of its whole batches once."""
    ids = np.concatenate([b["id"].numpy() for b in batches])
    assert len(np.unique(ids)) == len(ids) == ROWS // 32 * 32
    return ids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("prefetch", [0, 6])
def test_the_data_plane_gives_the_batches_flight_gives(source, shuffle, prefetch):
    wire = _serve(CacheServer(source, batch_bytes=512, data_port=0))
    plain = _serve(CacheServer(source, batch_bytes=512))
    try:
        assert wire.stats()["data_port"] == wire.wire.port and plain.stats()["data_port"] is None
        ours = _epoch(wire, shuffle=shuffle, prefetch=prefetch)
        theirs = _epoch(plain, shuffle=shuffle, prefetch=prefetch)
        assert wire.wire.requests >= (ROWS // 32 if prefetch == 0 else 1)  # read over the data plane
        if prefetch == 0:  # a call a step, one after another over one connection
            assert wire.wire.connections == 1
    finally:
        wire.shutdown()
        plain.shutdown()
    assert len(ours) == len(theirs) == ROWS // 32
    for a, b in zip(ours, theirs, strict=True):
        assert a["id"].tolist() == b["id"].tolist()
        assert (a["tokens"][:, 0] == a["id"]).all() and a["tokens"].shape == (32, 8)
    ids = _every_row_once(ours)
    assert (np.diff(ids) == 1).all() != shuffle


def _steps(reader: WireReader, count: int) -> list[pa.RecordBatch]:
    try:
        return [reader.read_chunk().data for _ in range(count)]
    finally:
        reader.cancel()


@pytest.mark.timeout(60)
def test_a_request_is_checked_and_its_columns_sent_as_asked(source):
    node = _serve(CacheServer(source, data_port=0))
    address = ("127.0.0.1", node.wire.port)
    try:
        ticket = encode_ticket([np.array([[5, 7], [100, 101]]), np.array([[0, 3]])], ["text"])
        reader = WireReader(address, node.node_id, None, ticket, 2, 10)
        first, second = _steps(reader, 2)
        assert first.schema.names == ["text"] and first.column(0).to_pylist() == ["row 5", "row 6", "row 100"]
        assert second.column(0).to_pylist() == ["row 0", "row 1", "row 2"]
        for ticket, reason in [(encode_ticket([np.array([[0, ROWS + 1]])]), f"rows [0, {ROWS + 1}) are not on "
                                                                              f"this node, which holds [0, {ROWS})"),
                               (encode_ticket([np.array([[0, 2]])], ["nothing"]), "no column nothing here"),
                               (b"not a ticket", "not a datacache ticket")]:
            with pytest.raises(flight.FlightServerError, match=re.escape(reason)):
                WireReader(address, node.node_id, None, ticket, 1, 10)
        with socket.create_connection(address, timeout=10) as raw:  # not our protocol at all
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
            answer = b"".join(iter(lambda: raw.recv(256), b""))
        assert answer[:1] == b"\x01" and answer[5:] == b"not a datacache data-plane request (datacache.wire)"
    finally:
        node.shutdown()


@pytest.mark.timeout(60)
def test_a_wrong_token_is_refused_on_the_data_plane_too(source):
    node = _serve(CacheServer(source, data_port=0, token="s3cret"))
    try:
        address = ("127.0.0.1", node.wire.port)
        with pytest.raises(flight.FlightUnauthenticatedError, match="a wrong or missing token"):
            WireReader(address, node.node_id, "guess", encode_ticket([np.array([[0, 2]])]), 1, 10)
        # Refused before the ticket is read: a client without the token gets nothing more out of the node.
        with socket.create_connection(address, timeout=10) as raw:
            raw.sendall(b"DCW1" + b"".join(struct.pack("<I", len(f)) + f for f in (node.node_id.encode(), b"guess"))
                        + struct.pack("<I", 16 << 20))
            assert b"".join(iter(lambda: raw.recv(256), b""))[:1] == b"\x02"
        # The client learns the data port from the node only with the right token: Flight refuses first.
        with pytest.raises(DataCacheError, match="refused this client: a wrong or missing token"):
            _epoch(node, token="guess")
        assert len(_epoch(node, token="s3cret")) == ROWS // 32
    finally:
        node.shutdown()


class _FailingNode(CacheServer):
    """A real node whose third step fails while it is sent: once as a node restarting does (`restart`, which
    the client retries), or always as a bug does (out of memory in a gather)."""

    def __init__(self, *args, restart: bool, **kw):
        super().__init__(*args, **kw)
        self.restart, self.tickets = restart, 0

    def answer(self, ticket):
        self.tickets += 1
        return super().answer(ticket)

    def _step_batches(self, steps, rows):
        for i, batch in enumerate(super()._step_batches(steps, rows)):
            if i == 2 and self.tickets == 1:
                if self.restart:
                    raise flight.FlightUnavailableError("restarting")
                raise MemoryError("no room at /srv/private/node.py")
            yield batch


@pytest.mark.timeout(60)
def test_a_stream_broken_on_the_data_plane_resumes_at_the_first_step_it_had_not_delivered(source):
    node = _serve(_FailingNode(source, batch_bytes=256, data_port=0, restart=True))
    try:
        batches = _epoch(node, shuffle=True, prefetch=4)
    finally:
        node.shutdown()
    assert node.tickets >= 2
    _every_row_once(batches)


@pytest.mark.timeout(60)
def test_a_node_that_fails_while_sending_is_named_with_its_reason_not_its_traceback(source):
    node = _serve(_FailingNode(source, data_port=0, restart=False))
    try:
        reader = WireReader(("127.0.0.1", node.wire.port), node.node_id, None,
                            encode_ticket([np.array([[i, i + 1]]) for i in range(4)]), 4, 10)
        with pytest.raises(flight.FlightServerError) as e:
            _steps(reader, 4)
        assert str(e.value) == "datacache: the node failed while sending; its log says why"
        ds = StreamingDataset([node.location], columns=["id"], batch_size=1, shuffle=False, prefetch=4, retries=0)
        node.tickets = 0
        with pytest.raises(DataCacheError, match=re.escape(f"cache node {node.location} refused do_get: the node "
                                                           "failed while sending; its log says why")):
            for _ in ds:
                pass
    finally:
        node.shutdown()


@pytest.mark.timeout(60)
def test_a_shuffled_step_asked_of_a_node_shutting_down_is_unavailable_and_logs_no_traceback(source, caplog):
    """The gather threads stop last at a shutdown: a stream still asking for a gathered step then hears that the
    node is going (retried elsewhere or later), on either plane, and the node logs no traceback."""
    node = _serve(CacheServer(source, data_port=0))
    try:
        node._gathers.shutdown()
        ticket = encode_ticket([np.array([[0, 2], [5, 7]]), np.array([[9, 12]])])
        with caplog.at_level(logging.INFO):
            with pytest.raises(flight.FlightUnavailableError, match="datacache: the node is shutting down"):
                _steps(WireReader(("127.0.0.1", node.wire.port), node.node_id, None, ticket, 2, 10), 2)
            with pytest.raises(flight.FlightUnavailableError, match="datacache: the node is shutting down"):
                flight.connect(node.location).do_get(flight.Ticket(ticket)).read_all()
        assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
    finally:
        node.shutdown()


def _epoch_then_shutdown(node: CacheServer, caplog, prefetch: int) -> tuple[list[dict], list[str]]:
    """A shuffled epoch from `node`, whose data plane the test closed, then the node shut down; and the client's
    warnings that a data port cannot be used."""
    try:
        with caplog.at_level(logging.WARNING, logger="datacache.dataset"):
            batches = _epoch(node, shuffle=True, prefetch=prefetch)
    finally:
        node.wire = None  # closed already
        node.shutdown()
    return batches, [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]


@pytest.mark.timeout(60)
def test_a_data_port_the_client_cannot_reach_leaves_it_on_flight(source, caplog):
    node = _serve(CacheServer(source, batch_bytes=512, data_port=0))
    node.wire.close()  # the port named in the node's FlightInfo now refuses connections, as a firewall would
    batches, warnings = _epoch_then_shutdown(node, caplog, prefetch=6)
    _every_row_once(batches)
    assert len(warnings) == 1 and node.location in warnings[0] and "reading over Flight" in warnings[0]


@pytest.mark.timeout(60)
def test_a_node_under_tls_has_no_data_plane(source, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    node = CacheServer(source, location="grpc+tls://localhost:0", tls_cert=str(cert), tls_key=str(key), data_port=0)
    try:
        assert node.wire is None and node.stats()["data_port"] is None
    finally:
        node.shutdown()


@pytest.mark.timeout(120)
def test_serve_opens_a_data_port_unless_told_off(source):
    def stats(*flags):
        proc = subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", "0", *flags],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            location = proc.stdout.readline().split()[-1]
            info = flight.FlightClient(location).get_flight_info(flight.FlightDescriptor.for_path("dataset"))
            return location, json.loads(info.app_metadata)
        finally:
            proc.terminate()
            proc.wait(10)

    location, meta = stats()
    assert isinstance(meta["data_port"], int) and meta["data_port"] > 0
    assert stats("--data-port", "off")[1]["data_port"] is None
    port = int(location.rsplit(":", 1)[1])
    proc = subprocess.run([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", str(port),
                           "--data-port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"--data-port {port}: the same as --port" in proc.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", "0",
                               "--data-port", str(taken)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"--data-port {taken}: cannot listen there: already in use" in proc.stderr


class _SlowNode(CacheServer):
    """A real node that takes `delay` seconds a step, so that a stream is in flight between two steps."""

    def __init__(self, *args, delay: float, **kw):
        super().__init__(*args, **kw)
        self.delay = delay

    def _step_batches(self, steps, rows):
        for batch in super()._step_batches(steps, rows):
            time.sleep(self.delay)
            yield batch


@pytest.mark.timeout(60)
def test_a_data_plane_cut_between_two_steps_resumes_over_flight_with_every_row_once(source, caplog):
    node = _serve(_SlowNode(source, batch_bytes=256, data_port=0, delay=0.05))
    plane = node.wire
    threading.Timer(0.5, plane.close).start()  # the streams in flight are cut, the port closed
    batches, warnings = _epoch_then_shutdown(node, caplog, prefetch=8)
    assert plane.requests >= 1 and warnings
    _every_row_once(batches)


@pytest.mark.timeout(60)
def test_a_port_that_serves_another_node_now_is_not_read_and_a_new_one_is_found(source, monkeypatch):
    first, second = (_serve(CacheServer(source, batch_bytes=512, data_port=0)) for _ in range(2))
    try:
        with pytest.raises(Unreachable, match="this port now serves another node"):
            WireReader(("127.0.0.1", second.wire.port), first.node_id, None, encode_ticket([np.array([[0, 2]])]), 1,
                       10)
        # `first` restarts its data plane on another port: a client looks at its FlightInfo again and reads there.
        monkeypatch.setattr(_DataPlane, "RECHECK", 0.0)
        ds = StreamingDataset([first.location], columns=["id"], batch_size=32, shuffle=False, prefetch=0)
        ds.describe()
        first.wire.close()
        first.wire = WireServer("127.0.0.1", 0, first.node_id, None, first.answer)
        ids = np.concatenate([b["id"].numpy() for b in ds])
        assert first.wire.requests >= ROWS // 32 - 1 and (ids == np.arange(ROWS // 32 * 32)).all()
    finally:
        for node in (first, second):
            node.shutdown()


def test_a_message_length_is_read_from_its_metadata_as_arrow_writes_it():
    ids = np.arange(300)
    batch = pa.record_batch({"id": ids, "text": [f"row {i}" if i % 7 else None for i in ids],
                             "nested": [{"a": [int(i)] * (i % 3)} for i in ids]})
    for b in (batch, batch.slice(5, 40), batch.take(pa.array(ids[::-3])), batch.slice(0, 0)):
        message = b.serialize()
        (size,) = struct.unpack_from("<i", message, 4)
        metadata = np.frombuffer(message, np.uint8, size, 8)
        assert _body_length(metadata) == pa.ipc.read_message(message).body.size == len(message) - 8 - size


@pytest.mark.timeout(60)
def test_dictionary_columns_are_read_over_flight(tmp_path):
    path = tmp_path / "labels.parquet"
    ids = np.arange(500)
    labels = pa.array([["cat", "dog", "eel"][i % 3] for i in ids]).dictionary_encode()
    pq.write_table(pa.table({"id": ids, "label": labels}), path)
    node = _serve(CacheServer(str(path), data_port=0))
    try:
        ds = StreamingDataset([node.location], columns=["id"], batch_size=50, shuffle=False)
        ds.describe()
        assert ds._nodes[0].data is not None  # a plain column: the data plane
        with_labels = StreamingDataset([node.location], columns=["id", "label"], batch_size=50, shuffle=False)
        with_labels.describe()
        assert with_labels._nodes[0].data is None
    finally:
        node.shutdown()


@pytest.mark.timeout(60)
def test_a_connection_serves_call_after_call_and_one_the_node_closed_idle_is_made_anew(source, monkeypatch):
    monkeypatch.setattr(wire, "IDLE_TIMEOUT", 0.5)
    node = _serve(CacheServer(source, batch_bytes=512, data_port=0))
    try:
        ds = StreamingDataset([node.location], columns=["id"], batch_size=32, shuffle=False, prefetch=0)
        first = np.concatenate([b["id"].numpy() for b in ds])
        assert node.wire.requests == ROWS // 32 and node.wire.connections == 1
        time.sleep(1.5)  # the node closes the idle connection; the client finds it closed at its next call
        second = np.concatenate([b["id"].numpy() for b in ds])
        assert node.wire.requests == 2 * (ROWS // 32) and node.wire.connections == 2
    finally:
        node.shutdown()
    assert (first == second).all() and (first == np.arange(ROWS // 32 * 32)).all()


@pytest.mark.timeout(60)
def test_only_an_answer_read_to_its_end_gives_its_connection_back_and_a_closed_one_is_replaced(source):
    node = _serve(CacheServer(source, data_port=0))
    address, ticket = ("127.0.0.1", node.wire.port), encode_ticket([np.array([[i, i + 2]]) for i in range(3)])
    try:
        partial = WireReader(address, node.node_id, None, ticket, 3, 10)
        partial.read_chunk()
        assert partial.release() is None  # two steps unread: never another call's answer
        whole = WireReader(address, node.node_id, None, ticket, 3, 10)
        steps = [whole.read_chunk().data for _ in range(3)]
        idle = whole.release()
        assert idle is not None and [b.column("id").to_pylist() for b in steps] == [[0, 1], [1, 2], [2, 3]]
        idle.shutdown(socket.SHUT_RDWR)  # as the node does when the connection has idled too long
        again = WireReader(address, node.node_id, None, ticket, 3, 10, idle=idle)
        assert [again.read_chunk().data.column("id").to_pylist() for _ in range(3)][-1] == [2, 3]
        again.cancel()
    finally:
        node.shutdown()


def test_an_extension_column_over_a_dictionary_stays_on_flight():
    class Labels(pa.ExtensionType):
        def __init__(self):
            super().__init__(pa.dictionary(pa.int8(), pa.string()), "test.labels")

        def __arrow_ext_serialize__(self):
            return b""

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type, serialized):
            return cls()

    assert _has_dictionary(Labels()) and _has_dictionary(pa.list_(pa.dictionary(pa.int8(), pa.string())))
    assert not _has_dictionary(pa.struct([("a", pa.list_(pa.int32(), 4))]))
