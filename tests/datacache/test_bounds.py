"""A node bounds what one request costs and says what is wrong with a bad ticket (no traceback, no path);
its token comes from a file or the environment and is compared in constant time; a client checks every
step it receives and names the node that answered wrong. Real Flight servers on loopback, real processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import datacache.server
from datacache import CacheServer, DataCacheError, StreamingDataset
from datacache.__main__ import main
from datacache.server import MAX_TICKET_STEPS, encode_ticket
from tests.datacache.test_no_hang import endpoint, stop, write_rows

ROWS = 64


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("bounds") / "rows.parquet", ROWS, 16)


@pytest.fixture(scope="module")
def node(source):
    server = CacheServer(source)
    threading.Thread(target=server.serve, daemon=True).start()
    yield server
    server.shutdown()


def _refusal(location: str, ticket: bytes) -> str:
    with pytest.raises(flight.FlightServerError) as e:
        flight.FlightClient(location).do_get(flight.Ticket(ticket)).read_all()
    message = str(e.value)
    assert "Traceback" not in message and ".py" not in message and "/work" not in message
    return message


def _ints(*values) -> bytes:
    return np.array(values, dtype="<i8").tobytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ticket,problem", [
    (b'{"steps": Infinity}\n', "Infinity is not a number a ticket may hold"),
    (b'{"steps": 1e400}\n', '"steps" must be an integer in [0, 65536], not Infinity'),
    (b'{"steps": 99999999999999999999999}\n' + _ints(0, 0, 1), '"steps" must be an integer in [0, 65536]'),
    (b'{"steps": 1.0}\n' + _ints(1, 0, 1), '"steps" must be an integer'),
    (b'{"steps": 1, "columns": 5}\n' + _ints(1, 0, 1), '"columns" must be a list of column names or null, not 5'),
    (b'{"steps": 1, "columns": [7]}\n' + _ints(1, 0, 1), '"columns" must be a list of column names'),
    (b'[1]\n', "the header is not a JSON object"),
    (b'\xc3(\n', "codec can't decode byte 0xc3"),
    (b'{"steps": 1}', "no JSON header line"),
    (b'{"steps": 1}\n\x01\x02\x03', "the body is not 1 range counts and [start, stop) pairs of int64"),
    (b'{"steps": 1}\n' + _ints(-1, 0, 1), "the steps' range counts add up to -1, but the ticket holds 1 ranges"),
    (b'{"steps": 2}\n' + _ints(1, 1, 0, 1), "add up to 2, but the ticket holds 1 ranges"),
])
def test_a_malformed_ticket_is_refused_saying_what_is_wrong(node, ticket, problem):
    message = _refusal(node.location, ticket)
    assert "datacache: not a datacache ticket" in message and problem in message


@pytest.mark.timeout(60)
def test_a_request_is_bounded_before_anything_is_sent(node, monkeypatch):
    # One step repeating the node's rows 64 times: 64 times the node, allocated by one gather, is refused.
    whole = np.array([[0, ROWS]] * 64)
    assert f"a step of {64 * ROWS} rows is more than this node holds ({ROWS})" in _refusal(
        node.location, encode_ticket([whole]))
    assert f"must be an integer in [0, {MAX_TICKET_STEPS}], not {MAX_TICKET_STEPS + 1}" in _refusal(
        node.location, encode_ticket([np.array([[0, 1]])] * (MAX_TICKET_STEPS + 1)))
    assert "rows [5, 5) are no rows" in _refusal(node.location, encode_ticket([np.array([[5, 5]])]))
    assert "rows [9, 3) are no rows" in _refusal(node.location, encode_ticket([np.array([[9, 3]])]))
    monkeypatch.setattr(datacache.server, "MAX_TICKET_RANGES", 100)
    assert "101 row ranges; a ticket may hold at most 100" in _refusal(
        node.location, encode_ticket([np.array([[i, i + 1] for i in range(50)])] * 2 + [np.array([[0, 1]])]))
    # What the node may send is still sent: one step of every row, and many steps in one ticket.
    reader = flight.FlightClient(node.location).do_get(flight.Ticket(encode_ticket([np.array([[0, ROWS]])] * 50)))
    assert reader.read_all().num_rows == 50 * ROWS


def _cli(capsys, *args, env=None) -> tuple[int, str]:
    """`python -m datacache ARGS`'s exit code and stderr, run in this process (the nodes are processes)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in (env or {}).items():
            mp.setenv(k, v)
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    return code, capsys.readouterr().err


@pytest.mark.timeout(120)
def test_serve_reads_its_token_from_a_file_or_the_environment_not_the_command_line(source, tmp_path, capsys):
    secret = tmp_path / "token"
    secret.write_text("s3cret-from-file\n")
    from_file = subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", "0",
                                  "--token-file", str(secret)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
    from_env = subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "TRAINJOB_CACHE_TOKEN": "s3cret-from-env"})
    try:
        a, b = endpoint(from_file), endpoint(from_env)
        for proc in (from_file, from_env):
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                assert b"s3cret" not in f.read()  # what `ps` shows every user
        assert _cli(capsys, "ready", a)[0] == 1 and _cli(capsys, "ready", b)[0] == 1
        assert _cli(capsys, "ready", a, "--token-file", str(secret))[0] == 0
        assert _cli(capsys, "ready", b, env={"TRAINJOB_CACHE_TOKEN": "s3cret-from-env"})[0] == 0
        code, err = _cli(capsys, "stat", a, "--token", "wrong")
        assert code == 1 and "missing or wrong token" in err
        os.environ["TRAINJOB_CACHE_TOKEN"] = "s3cret-from-env"  # a rank gets its token so, from its launcher
        try:
            ds = StreamingDataset([b], columns=["id"], batch_size=8, shuffle=False, loop=False)
            assert sum(len(batch["id"]) for batch in ds) == ROWS
        finally:
            del os.environ["TRAINJOB_CACHE_TOKEN"]
    finally:
        stop([from_file, from_env])
    code, err = _cli(capsys, "serve", "--source", source, "--token", "x", "--token-file", str(secret))
    assert code == 2 and "--token and --token-file: give one" in err
    empty = tmp_path / "empty"
    empty.write_text("")
    code, err = _cli(capsys, "serve", "--source", source, "--token-file", str(empty))
    assert code == 2 and f"--token-file {empty}: the file is empty" in err
    code, err = _cli(capsys, "serve", "--source", source, "--token-file", str(tmp_path / "nothing"))
    assert code == 2 and "nothing: No such file or directory" in err


class LyingNode(CacheServer):
    """A real node that answers every step with one row fewer (`short`) or with float tokens."""

    def __init__(self, *args, short=False, floats=False, **kw):
        super().__init__(*args, **kw)
        self.short, self.floats = short, floats
        threading.Thread(target=self.serve, daemon=True).start()

    def do_get(self, context, ticket):
        steps, rows = self._request(ticket.ticket)
        batches = (b.slice(0, b.num_rows - 1) if self.short else b for b in self._step_batches(steps, rows))
        if not self.floats:
            return flight.GeneratorStream(rows.schema, batches)
        schema = pa.schema([pa.field("tokens", pa.list_(pa.float32(), 16))])
        return flight.GeneratorStream(schema, (pa.record_batch([b.column("tokens").cast(schema.field(0).type)],
                                                               schema=schema) for b in batches))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [0, 4])
def test_a_client_refuses_a_short_batch_or_float_tokens_naming_the_node(source, prefetch):
    honest, short = CacheServer(source, shard=0, num_shards=2), LyingNode(source, shard=1, num_shards=2, short=True)
    floats = LyingNode(source, floats=True)
    threading.Thread(target=honest.serve, daemon=True).start()
    try:
        two = StreamingDataset([honest.location, short.location], batch_size=8, shuffle=False, prefetch=prefetch)
        with pytest.raises(DataCacheError, match=re.escape(f"cache node {short.location} answered a step with 7 rows "
                                                           f"where 8 were asked for")):
            for _ in two:
                pass
        one = StreamingDataset([floats.location], batch_size=8, prefetch=prefetch)
        with pytest.raises(DataCacheError, match=re.escape(
                f"cache node {floats.location} answered with columns tokens: fixed_size_list<item: float>[16]; "
                f"asked for tokens: fixed_size_list<element: int32>[16]")):
            next(iter(one))
    finally:
        for server in (honest, short, floats):
            server.shutdown()



class FailingNode(CacheServer):
    """A real node whose second step fails while it is being sent (say, out of memory in a gather)."""

    def _step_batches(self, steps, rows):
        batches = super()._step_batches(steps, rows)
        yield next(batches)
        raise MemoryError("no room at /srv/private/node.py")


def test_a_node_that_fails_while_sending_says_so_in_one_line(source):
    node = FailingNode(source)
    threading.Thread(target=node.serve, daemon=True).start()
    try:
        ticket = encode_ticket([np.array([[0, 8]]), np.array([[8, 16]])])
        message = _refusal(node.location, ticket)
        assert "the node failed while sending; its log says why" in message
        assert "/srv/private" not in message
    finally:
        node.shutdown()
