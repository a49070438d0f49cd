"""The data plane beside Flight: a node's answer to a ticket as an Arrow IPC stream over a plain TCP socket.

Flight's `do_get` costs the reading process about twice what the bytes' crossing does: gRPC hands each message
over in slices, which Arrow's Flight client joins into one buffer (docs/data-cache.md's table). Here a record
batch crosses once: the node writes its buffers from the held rows straight into the socket (Arrow's IPC
writer over a sink that sends each large buffer as it is given, no copy in the node, and a step's small
pieces together), and the client receives each message into one buffer it allocates (its length from the
message's metadata) and reads the batch over it, zero-copy, as a raw socket's reader would, with one Python
call a step.

A node started with a data port (`python -m datacache serve`, `--data-port`, default a free port; the trainer's
nodes too) names it in its FlightInfo's `app_metadata` (`data_port`), and `StreamingDataset` then reads its
steps here, asking with the same ticket (`encode_ticket`) and getting what `do_get` sends, checked the same
way (the node's `answer`). Flight stays the control plane (what a node holds, health, stats, Kubeflow's
protocol) and the path of a node without a data port (`CacheServer`'s default, and under TLS: this plane is
not encrypted), of columns holding dictionaries (their batches come with dictionary messages this reader
does not take), or of a port the client cannot reach (a firewall, a port not forwarded): then the client
uses `do_get`, and says so once in its log.

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

Errors reach the client as the Flight errors its reader already handles: `FlightServerError` for a refusal,
`FlightUnauthenticatedError` for a token, `FlightTimedOutError` when nothing comes within the timeout. A
node that fails while sending a step sends, in its place, FAILURE (four bytes no IPC message starts with),
then the Flight error's class name and its reason as two frames, as Flight sends an error status, and stops.
A stream cut short, or ended before the steps asked for (the node died or shut down between two steps), is a
ConnectionError, retried as Flight's failures are, from the first step not yet read.
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
# An IPC message's first four bytes; a failure's, which no IPC message starts with.
CONTINUATION, FAILURE = 0xFFFFFFFF, 0xFFFFFFFE
MAX_BODY = 1 << 40  # bytes a message's body may say it holds; past that, its metadata is not a message's
REQUEST_TIMEOUT = 30.0  # seconds a connected client has to send its whole request
IDLE_TIMEOUT = 120.0  # seconds a connection waits for its next request before the node closes it
MAX_CONNECTIONS = 1024  # connections served at once: a client's readers hold one each to every node
SMALL = 64 << 10  # bytes: message parts below this are sent together, and received through the reader's buffer
CONNECT_TIMEOUT = 5.0  # at most, seconds a client waits to connect before it takes the port for unreachable

Answer = Callable[[bytes], tuple[pa.Schema, Iterator[pa.RecordBatch]]]


def _receive_into(sock: socket.socket, out: np.ndarray) -> int:
    """Fills `out` (uint8) from `sock`; how many bytes came (fewer where the peer closed first)."""
    view, got = memoryview(out), 0
    while got < len(out):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def _receive_exactly(sock: socket.socket, size: int) -> np.ndarray:
    """`size` bytes from `sock` in a fresh buffer; fewer where the peer closed first."""
    buf = np.empty(size, dtype=np.uint8)
    return buf[: _receive_into(sock, buf)]


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
    """What Arrow's IPC writer writes to: a buffer of SMALL bytes or more is sent as it is (no copy here); smaller
    pieces (a message's metadata, a small batch's buffers, padding) are gathered and sent together at `flush`,
    or once they reach SMALL, so that a small step costs a send, not one per piece."""

    closed = False

    def __init__(self, sock: socket.socket):
        self.sock, self.pending = sock, bytearray()

    def write(self, data) -> int:
        size = len(data)
        if size < SMALL:
            self.pending += data
            if len(self.pending) >= SMALL:
                self.flush()
        else:
            self.flush()
            self.sock.sendall(data)
        return size

    def flush(self) -> None:
        if self.pending:
            self.sock.sendall(self.pending)
            self.pending.clear()

    def close(self) -> None:
        pass


def _body_length(metadata: np.ndarray) -> int:
    """The `bodyLength` of an IPC message from its flatbuffer metadata (Arrow's format/Message.fbs: table
    Message { version; header_type; header; bodyLength: long; custom_metadata }, field 3), 0 where absent."""
    (table,) = struct.unpack_from("<I", metadata, 0)
    vtable = table - struct.unpack_from("<i", metadata, table)[0]
    (vtable_size,) = struct.unpack_from("<H", metadata, vtable)
    slot = 4 + 2 * 3
    offset = struct.unpack_from("<H", metadata, vtable + slot)[0] if slot + 2 <= vtable_size else 0
    return struct.unpack_from("<q", metadata, table + offset)[0] if offset else 0


class _Messages:
    """An Arrow IPC stream's messages off a socket, each received whole into one buffer of its own, which the
    batch read from it then views (`pa.ipc.read_message` over it: no copy). Bytes come off the socket SMALL at
    a time into this reader's buffer, from which a message's prefix and metadata are copied (a small step costs
    a receive or less); the rest of a large body is received straight into its message's buffer. What it holds
    past the end marker is dropped with it: a node sends nothing after that marker until the next request."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._chunk, self._start, self._end = bytearray(SMALL), 0, 0

    def _fill(self, out: np.ndarray) -> int:
        """Receives into all of `out`; how many bytes came (fewer where the peer closed first)."""
        size = len(out)
        got = min(size, self._end - self._start)
        out[:got] = np.frombuffer(self._chunk, np.uint8, got, self._start)
        self._start += got
        if size - got >= SMALL:
            return got + _receive_into(self.sock, out[got:])
        while got < size:
            self._start, self._end = 0, self.sock.recv_into(self._chunk)
            if self._end == 0:
                break
            take = min(size - got, self._end)
            out[got : got + take] = np.frombuffer(self._chunk, np.uint8, take)
            self._start, got = take, got + take
        return got

    def _exactly(self, size: int, what: str) -> np.ndarray:
        out = np.empty(size, dtype=np.uint8)
        if self._fill(out) < size:
            raise ConnectionError(f"the node's stream stopped short, in {what}")
        return out

    def _failure(self, kind_size: int) -> flight.FlightError:
        """The failure after FAILURE and the length of its kind (the prefix's second field)."""
        kind = getattr(flight, self._exactly(kind_size, "a failure").tobytes().decode(errors="replace"), None)
        (reason_size,) = struct.unpack("<I", self._exactly(4, "a failure"))
        reason = self._exactly(reason_size, "a failure").tobytes().decode(errors="replace")
        if not (isinstance(kind, type) and issubclass(kind, flight.FlightError)):
            kind = flight.FlightServerError
        return kind(reason)

    def next(self) -> pa.ipc.Message | None:
        """The next message; None at the stream's end marker. Raises the node's failure, sent in its place."""
        prefix = self._exactly(8, "a message's prefix")
        mark, size = struct.unpack("<Ii", prefix)
        if mark == FAILURE:
            raise self._failure(size)
        if mark != CONTINUATION or size < 0:
            raise ConnectionError("the node's stream is not an Arrow IPC stream")
        if size == 0:
            return None
        metadata = self._exactly(size, "a message's metadata")
        try:
            body = _body_length(metadata)
        except struct.error:
            body = -1
        if not 0 <= body <= MAX_BODY:
            raise ConnectionError("the node's stream holds a message whose metadata cannot be read")
        whole = np.empty(8 + size + body, dtype=np.uint8)
        whole[:8], whole[8 : 8 + size] = prefix, metadata
        if self._fill(whole[8 + size :]) < len(whole) - 8 - size:
            raise ConnectionError("the node's stream stopped short, in a message's body")
        return pa.ipc.read_message(pa.py_buffer(whole))


class _Handler(socketserver.BaseRequestHandler):
    server: WireServer

    def setup(self) -> None:
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a vanished client frees the thread
        # A small step goes out at once (Nagle would hold it until the last one is acknowledged), as gRPC's do.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle(self) -> None:
        """Requests one after another on the connection (a client reuses it), each answered whole, until one is
        refused or fails, the client goes, or none comes for IDLE_TIMEOUT seconds."""
        first = True
        while self._answer_one(first):
            first = False

    def _answer_one(self, first: bool) -> bool:
        """Reads a request and answers it; whether the connection can take another."""
        sock: socket.socket = self.request
        if not first:  # an idle connection: closed quietly when its client closes it or lets it wait too long
            try:
                sock.settimeout(IDLE_TIMEOUT)
                if not sock.recv(1, socket.MSG_PEEK):
                    return False
            except OSError:
                return False
        try:
            sock.settimeout(REQUEST_TIMEOUT)
            magic = _receive_exactly(sock, 4).tobytes()
            deadline = time.monotonic() + REQUEST_TIMEOUT
            if magic != MAGIC:
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
        with self.server._lock:
            self.server.requests += 1
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
            sink = _SocketSink(sock)
            writer = pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), schema)
            try:
                for batch in batches:
                    writer.write_batch(batch)
                    sink.flush()
            except OSError:
                raise
            except Exception as e:  # the answer's own failure (`answer` makes it one line): in the stream
                if not isinstance(e, flight.FlightError):
                    log.exception("data plane while sending")
                    e = flight.FlightServerError("datacache: the node failed while sending; its log says why")
                sink.flush()
                kind, reason = type(e).__name__.encode(), str(e).encode()
                sock.sendall(struct.pack("<II", FAILURE, len(kind)) + kind + struct.pack("<I", len(reason)) + reason)
                return False
            writer.close()  # the schema (for a ticket of no steps) and the end marker
            sink.flush()
            return True
        except OSError:  # the client went away (it stopped reading, or cancelled): nothing to tell it
            return False

    def _refuse(self, status: bytes, reason: str) -> bool:
        """Sends the refusal; the connection then closes (False)."""
        text = reason.encode()
        with contextlib.suppress(OSError):  # a client that went away needs no answer
            self.request.sendall(status + struct.pack("<I", len(text)) + text)
        return False


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
        self.connections = self.requests = 0  # taken and answered, for whoever wants to know the plane is read
        self._thread = threading.Thread(target=self.serve_forever, name="datacache-wire", daemon=True)
        self._thread.start()

    def process_request(self, request, client_address) -> None:
        with self._lock:
            if len(self._open) >= MAX_CONNECTIONS:
                self.shutdown_request(request)  # the client sees the connection closed, and retries
                return
            self._open.add(request)
            self.connections += 1
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
    stream reader gives them. Over `idle` (a connection a finished reader gave back: `release()`) where given,
    else a new one; `cancel()` closes it. Raises `Unreachable` when it cannot connect or the port serves another
    node now, `ConnectionError` when the connection breaks or the stream ends early, and the Flight errors
    named in the module's docstring."""

    Chunk = collections.namedtuple("Chunk", "data")

    def __init__(self, address: tuple[str, int], node_id: str, token: str | None, ticket: bytes, steps: int,
                 timeout: float, idle: socket.socket | None = None):
        self.steps, self.read, self.ended = steps, 0, False
        request = MAGIC + b"".join(struct.pack("<I", len(f)) + f for f in (node_id.encode(), (token or "").encode(),
                                                                             ticket))
        if idle is not None:
            try:
                self._ask(idle, request, timeout)
                return
            except ConnectionError as e:  # the node closed it meanwhile: connect anew
                if isinstance(e, Unreachable):
                    raise
        try:
            sock = socket.create_connection(address, timeout=min(timeout, CONNECT_TIMEOUT))
        except OSError as e:
            raise Unreachable(f"{address[0]}:{address[1]}: {e.strerror or e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ask(sock, request, timeout)

    def _ask(self, sock: socket.socket, request: bytes, timeout: float) -> None:
        self.sock = sock
        try:
            sock.settimeout(timeout)
            self._ipc(lambda: sock.sendall(request))
            status = self._receive(1).tobytes()
            if status != OK:
                self._refused(status)
            self.messages = _Messages(sock)
            first = self._ipc(self.messages.next)
            if first is None or first.type != "schema":
                raise ConnectionError("the node's stream does not start with its schema")
            self.schema = pa.ipc.read_schema(first)
        except BaseException:
            sock.close()
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
        message = self._ipc(self.messages.next)
        if message is None:
            if self.read < self.steps:  # the node ended the stream early (it closed between two steps)
                raise ConnectionError(f"the node's stream ended after {self.read} of {self.steps} steps")
            raise StopIteration
        self.read += 1
        batch = self._ipc(lambda: pa.ipc.read_record_batch(message, self.schema))
        if self.read == self.steps:  # the end marker follows the last step at once: then the connection is free
            try:
                self.ended = self._ipc(self.messages.next) is None
            except (OSError, flight.FlightError):  # the step is here all the same; the connection is not reused
                self.ended = False
        return self.Chunk(batch)

    def release(self) -> socket.socket | None:
        """The connection, for the next request, where this answer was read to its end; else it is closed."""
        if self.ended:
            return self.sock
        self.cancel()
        return None

    def cancel(self) -> None:
        self.sock.close()
