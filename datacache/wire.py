"""The data plane beside Flight: a node's answer to a ticket as an Arrow IPC stream over a plain TCP socket.

Flight's `do_get` costs the reading process about twice what the bytes' crossing does: gRPC hands each message
over in slices, which Arrow's Flight client joins into one buffer (docs/data-cache.md's table). Here a record
batch crosses once: the node writes its buffers from the held rows straight into the socket (Arrow's IPC
writer over a sink that sends each buffer as it is given, no copy in the node), and the client receives each
message body into one buffer it allocates (`read_buffer`, which Arrow's reader asks for) and reads the batch
over it, zero-copy, as a raw socket's reader would.

A node started with a data port (`python -m datacache serve`, `--data-port`, default a free port; the trainer's
nodes too) names it in its FlightInfo's `app_metadata` (`data_port`), and `StreamingDataset` then reads its
steps here, asking with the same ticket (`encode_ticket`) and getting what `do_get` sends, checked the same
way (the node's `answer`). Flight stays the control plane (what a node holds, health, stats, Kubeflow's
protocol) and the path of a node without a data port (`CacheServer`'s default, and under TLS: this plane is
not encrypted) or whose port the client cannot reach (a firewall, a port not forwarded): then the client uses
`do_get`, and says so once in its log.

The protocol, after the client connects (integers little-endian):

    request  b"DCW1", then three frames (u32 length, bytes): the node's id (its FlightInfo's `node_id`, so
             that a port another server took over since is not read as this node), the token (UTF-8, empty
             for none), the ticket; the node checks the id and the token before it reads the ticket, and the
             whole request must come within REQUEST_TIMEOUT
    answer   one status byte: OK, then an Arrow IPC stream (the schema, a record batch per step, the end
             marker); or REFUSED, UNAUTHENTICATED or ANOTHER_NODE, then u32 length and the reason (UTF-8),
             and the node closes the connection.

A node serves at most MAX_CONNECTIONS connections at once (a thread each) and closes the ones over that at
once; closing the data plane (`WireServer.close`, the node's shutdown) cuts the streams in flight.

A stream that ends before the steps asked for (the node died or shut down between two batches, which
Arrow's reader takes for the stream's end) is a ConnectionError too. A node that fails while sending a
step sends, in its place, an empty batch whose custom metadata holds the
reason and the Flight error's kind (`ERROR_KEY`, `KIND_KEY`), as Flight sends an error status, and ends the
stream. Errors reach the client as the
Flight errors its reader already handles: `FlightServerError` for a refusal or a failure while sending,
`FlightUnauthenticatedError` for a token, `FlightTimedOutError` when nothing comes within the timeout; a
stream cut short (the node died) is a ConnectionError, retried as Flight's failures are, from the first
step not yet read.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

log = logging.getLogger(__name__)

MAGIC = b"DCW1"
OK, REFUSED, UNAUTHENTICATED, ANOTHER_NODE = b"\x00", b"\x01", b"\x02", b"\x03"
MAX_ID, MAX_TOKEN = 256, 64 << 10
# encode_ticket's largest: a JSON line, then MAX_TICKET_STEPS counts and MAX_TICKET_RANGES ranges of int64.
MAX_TICKET = (64 << 10) + 8 * (1 << 16) + 16 * (1 << 20)
ERROR_KEY, KIND_KEY = b"datacache-error", b"datacache-error-kind"  # the reason, and its Flight error's class
REQUEST_TIMEOUT = 30.0  # seconds a connected client has to send its whole request
MAX_CONNECTIONS = 1024  # connections served at once: a client's readers hold one each to every node
CONNECT_TIMEOUT = 5.0  # at most, seconds a client waits to connect before it takes the port for unreachable

Answer = Callable[[bytes], tuple[pa.Schema, Iterator[pa.RecordBatch]]]


def _receive_exactly(sock: socket.socket, size: int) -> np.ndarray:
    """`size` bytes from `sock` into a fresh buffer; fewer where the peer closed first."""
    buf = np.empty(size, dtype=np.uint8)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return buf[:got]
        got += n
    return buf


def _receive_frame(sock: socket.socket, limit: int, what: str, deadline: float | None = None) -> bytes:
    """A u32-length-prefixed frame of at most `limit` bytes; with `deadline` (time.monotonic()), by then."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole request in {REQUEST_TIMEOUT:.0f} s")
        sock.settimeout(left)
    head = _receive_exactly(sock, 4)
    if len(head) < 4:
        raise ConnectionError(f"the connection closed before the {what}")
    (size,) = struct.unpack("<I", head)
    if size > limit:
        raise ValueError(f"a {what} of {size} bytes; at most {limit}")
    body = _receive_exactly(sock, size)
    if len(body) < size:
        raise ConnectionError(f"the connection closed in the {what}")
    return body.tobytes()


class _SocketSink:
    """What Arrow's IPC writer writes to: each buffer it is given, sent as it is (no copy here)."""

    closed = False

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def write(self, data) -> int:
        self.sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _SocketSource:
    """What Arrow's IPC reader reads from: `read_buffer` receives a message part into a buffer of its own, which
    the batch's arrays then view."""

    closed = False

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def read_buffer(self, size: int) -> np.ndarray:
        return _receive_exactly(self.sock, size)

    def read(self, size: int) -> bytes:
        return self.read_buffer(size).tobytes()

    def close(self) -> None:
        pass


class _Handler(socketserver.BaseRequestHandler):
    server: WireServer

    def setup(self) -> None:
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a vanished client frees the thread

    def handle(self) -> None:
        sock: socket.socket = self.request
        deadline = time.monotonic() + REQUEST_TIMEOUT
        try:
            sock.settimeout(REQUEST_TIMEOUT)
            if _receive_exactly(sock, 4).tobytes() != MAGIC:
                return self._refuse(REFUSED, "not a datacache data-plane request (datacache.wire)")
            if _receive_frame(sock, MAX_ID, "node id", deadline).decode(errors="replace") != self.server.node_id:
                return self._refuse(ANOTHER_NODE, "another node's request: this port now serves another node")
            token = _receive_frame(sock, MAX_TOKEN, "token", deadline)
            expected = self.server.token
            if expected is not None and not hmac.compare_digest(token, expected.encode()):
                return self._refuse(UNAUTHENTICATED, "a wrong or missing token")
            ticket = _receive_frame(sock, MAX_TICKET, "ticket", deadline)
        except (OSError, ValueError) as e:
            return self._refuse(REFUSED, f"a malformed request: {e}")
        try:
            schema, batches = self.server.answer(ticket)
        except flight.FlightError as e:
            return self._refuse(REFUSED, str(e))
        except Exception:  # a bug of ours: the client hears what kind, the node's log has the traceback
            log.exception("data plane request")
            return self._refuse(REFUSED, "datacache: the node failed on this ticket; its log says why")
        sock.settimeout(None)  # a slow reader holds the stream back (TCP's own flow control), as Flight's does
        try:
            sock.sendall(OK)
            with pa.ipc.new_stream(pa.PythonFile(_SocketSink(sock), mode="w"), schema) as writer:
                try:
                    for batch in batches:
                        writer.write_batch(batch)
                except OSError:
                    raise
                except Exception as e:  # the answer's own failure (`answer` makes it one line): in the stream
                    if not isinstance(e, flight.FlightError):
                        log.exception("data plane while sending")
                        e = flight.FlightServerError("datacache: the node failed while sending; its log says why")
                    writer.write_batch(pa.RecordBatch.from_pylist([], schema=schema),
                                       custom_metadata={ERROR_KEY: str(e).encode(), KIND_KEY: type(e).__name__})
        except OSError:  # the client went away (it stopped reading, or cancelled): nothing to tell it
            return

    def _refuse(self, status: bytes, reason: str) -> None:
        text = reason.encode()
        with contextlib.suppress(OSError):  # a client that went away needs no answer
            self.request.sendall(status + struct.pack("<I", len(text)) + text)


class WireServer(socketserver.ThreadingTCPServer):
    """A node's data plane on `host:port` (0: a free port, then `port` says which), a thread a connection,
    answering each request for `node_id` with `answer(ticket)` (the schema and the batches to send, or a
    `FlightError` to refuse it) once its `token` matches (None: none asked). Raises OSError where it cannot
    listen."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, host: str, port: int, node_id: str, token: str | None, answer: Answer):
        self.node_id, self.token, self.answer = node_id, token, answer
        self.address_family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        super().__init__((host.strip("[]"), port), _Handler)
        self.port = self.server_address[1]
        self.requests = 0  # connections taken, for whoever wants to know the plane is read
        self._thread = threading.Thread(target=self.serve_forever, name="datacache-wire", daemon=True)
        self._thread.start()

    def process_request(self, request, client_address) -> None:
        with self._lock:
            if len(self._open) >= MAX_CONNECTIONS:
                self.shutdown_request(request)  # the client sees the connection closed, and retries
                return
            self._open.add(request)
            self.requests += 1
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close(self) -> None:
        """Stops taking connections and cuts the streams in flight (their clients retry, at Flight)."""
        self.shutdown()
        self.server_close()
        with self._lock:
            streams = list(self._open)
        for sock in streams:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class Unreachable(ConnectionError):
    """The data port could not be connected to (refused, filtered, no route): the client reads over Flight."""


class WireReader:
    """The answer to a request for `steps` steps, a record batch a `read_chunk()` (its `.data`), as a Flight
    stream reader gives them; `cancel()` closes the connection. Raises `Unreachable` when it cannot connect or
    the port serves another node now, `ConnectionError` when the connection breaks or the stream ends early,
    and the Flight errors named in the module's docstring."""

    Chunk = collections.namedtuple("Chunk", "data")

    def __init__(self, address: tuple[str, int], node_id: str, token: str | None, ticket: bytes, steps: int,
                 timeout: float):
        self.steps, self.read = steps, 0
        try:
            self.sock = socket.create_connection(address, timeout=min(timeout, CONNECT_TIMEOUT))
        except OSError as e:
            raise Unreachable(f"{address[0]}:{address[1]}: {e.strerror or e}") from None
        try:
            self.sock.settimeout(timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            frames = [node_id.encode(), (token or "").encode(), ticket]
            self.sock.sendall(MAGIC + b"".join(struct.pack("<I", len(f)) + f for f in frames))
            status = self._receive(1).tobytes()
            if status != OK:
                self._refused(status)
            self.reader = self._ipc(lambda: pa.ipc.open_stream(pa.PythonFile(_SocketSource(self.sock), mode="r")))
        except BaseException:
            self.sock.close()
            raise

    def _receive(self, size: int) -> np.ndarray:
        data = self._ipc(lambda: _receive_exactly(self.sock, size))
        if len(data) < size:
            raise ConnectionError("the node closed the connection before its answer")
        return data

    def _refused(self, status: bytes):
        (size,) = struct.unpack("<I", self._receive(4).tobytes())
        reason = self._receive(size).tobytes().decode(errors="replace")
        if status == UNAUTHENTICATED:
            raise flight.FlightUnauthenticatedError(reason)
        if status == ANOTHER_NODE:
            raise Unreachable(reason)
        raise flight.FlightServerError(reason)

    @staticmethod
    def _ipc(fn):
        """`fn()`, its socket and stream errors as the reader's: a timeout as Flight's, a stream cut short as a
        ConnectionError."""
        try:
            return fn()
        except TimeoutError:
            raise flight.FlightTimedOutError("no data from the node within the timeout") from None
        except pa.ArrowInvalid as e:  # Arrow's reader given fewer bytes than a message needs
            raise ConnectionError(f"the node's stream stopped short: {e}") from None

    def read_chunk(self) -> Chunk:
        try:
            batch, metadata = self._ipc(self.reader.read_next_batch_with_custom_metadata)
        except StopIteration:
            if self.read < self.steps:  # a cut between two messages reads as the stream's end
                raise ConnectionError(f"the node's stream ended after {self.read} of {self.steps} steps") from None
            raise
        if metadata is not None and ERROR_KEY in metadata:
            kind = getattr(flight, metadata.get(KIND_KEY, b"").decode(), None)
            if not (isinstance(kind, type) and issubclass(kind, flight.FlightError)):
                kind = flight.FlightServerError
            raise kind(metadata[ERROR_KEY].decode(errors="replace"))
        self.read += 1
        return self.Chunk(batch)

    def cancel(self) -> None:
        self.sock.close()
