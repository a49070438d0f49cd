"""`python -m datacache`: run a cache node, describe one, or check that it is ready.

    python -m datacache serve --source 'data/*.parquet' --port 50051 [--shard 0/2] [--columns tokens]
                              [--filter "split == 'train'" | --sql "SELECT tokens FROM data WHERE quality > 0.5"]
                              [--advertise HOST:PORT] [--peers H0:P0,H1:P1] [--health-port 8080]
                              [--token-file PATH] [--tls-cert C --tls-key K] [--data-port 0|PORT|off]
    python -m datacache stat grpc://127.0.0.1:50051 [--token-file PATH]
    python -m datacache ready grpc://127.0.0.1:50051 [--token-file PATH]    # exit 0 once it serves (a readiness probe)

A node also answers Kubeflow Trainer's cache clients (`datacache.kubeflow`): `--advertise` is the address
it gives them (default: the bind host, or this machine's name for 0.0.0.0), `--peers` every node's address
in shard order so that any node answers for the whole table, and `--health-port` serves `GET /ready`.

Besides Flight, a node serves its steps on a data port (`datacache.wire`, default a free port; `--data-port off`:
Flight only), which `StreamingDataset` reads at about the speed of a raw socket.

The token (clients send it; the node refuses calls without it) comes from `--token-file`, or `--token`
(which every user of the machine sees in `ps`), else the TRAINJOB_CACHE_TOKEN environment variable.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:  # before the imports below, which the restart repeats
    from trainjob.allocator import restart_with_huge_pages

    restart_with_huge_pages()

import argparse
import errno
import ipaddress
import json
import logging
import os
import re
import socket
import ssl

import pyarrow as pa
import pyarrow.flight as flight

from datacache.server import CacheServer, DataCacheError, keep_gathered_buffers
from trainjob.cli import OneLineParser
from trainjob.env import CACHE_TOKEN_ENV


def _options(token: str | None) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(timeout=10, headers=[(b"authorization", f"Bearer {token}".encode())]
                                    if token else None)


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: give it as i/n, for example 0/2") from None
    return i, n


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port is a whole number from 0 to 65535 (0: any free one)")
    return port


_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*$")


def _data_port(text: str) -> int | None:
    return None if text == "off" else _port(text)


def _host(text: str) -> str:
    """An IP address, or a host name that is not a malformed address (256.1.1.1)."""
    try:
        ipaddress.ip_address(text.strip("[]"))
        return text
    except ValueError:
        pass
    if not _HOSTNAME.match(text) or re.fullmatch(r"[\d.]+", text):
        raise argparse.ArgumentTypeError(f"{text!r}: not an IP address or a host name")
    return text


def _endpoint(text: str) -> str:
    """A Flight location, scheme included: grpc://host:port (or grpc+tcp://, grpc+tls://)."""
    m = re.fullmatch(r"(grpc|grpc\+tcp|grpc\+tls)://(\[[^\]]+\]|[^:/\[\]]+):(\d+)", text)
    if not m or not 0 < int(m.group(3)) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: give a node's location as grpc://host:port "
                                         "(or grpc+tls://host:port)")
    return text


def _check_listen(parser: argparse.ArgumentParser, host: str, port: int, flag: str = "--port") -> None:
    """Before any data is read: the address can be bound (not in use, an address of this machine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            what = "already in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
            parser.error(f"--host {host} {flag} {port}: cannot listen there: {what}")


def _check_tls(parser: argparse.ArgumentParser, cert: str, key: str) -> None:
    """The certificate and key files exist, are PEM, and belong together."""
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not os.path.isfile(path):
            parser.error(f"{flag} {path}: no such file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        parser.error(f"--tls-cert {cert} --tls-key {key}: not a PEM certificate and its private key "
                     f"({e.strerror or e.reason or e})")


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.lower().rstrip("ib")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def _add_token(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", default=None,
                        help=f"a file holding the shared secret (else ${CACHE_TOKEN_ENV})")
    parser.add_argument("--token", default=None, help="the shared secret itself: visible to every user in `ps`; "
                                                      f"prefer --token-file or ${CACHE_TOKEN_ENV}")


def _token(args, parser: argparse.ArgumentParser) -> str | None:
    if args.token is not None and args.token_file is not None:
        parser.error("--token and --token-file: give one")
    if args.token_file is not None:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as e:
            parser.error(f"--token-file {args.token_file}: {e.strerror}")
        if not token:
            parser.error(f"--token-file {args.token_file}: the file is empty")
        return token
    return args.token or os.environ.get(CACHE_TOKEN_ENV) or None


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m datacache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="load Parquet data into memory and serve it over Arrow Flight")
    serve.add_argument("--source", required=True, help="a Parquet file, a directory or a glob")
    serve.add_argument("--host", type=_host, default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=50051)
    serve.add_argument("--shard", type=_shard, default=(0, 1), help="i/n: hold the i-th of n equal parts")
    serve.add_argument("--columns", default=None, help="comma-separated columns to keep (default: all)")
    serve.add_argument("--filter", default=None, help="rows to keep, e.g. \"split == 'train' and length >= 128\"")
    serve.add_argument("--sql", default=None, help="a DataFusion query over the source as table `data`, e.g. "
                                                   "\"SELECT tokens FROM data WHERE quality > 0.5\": the node "
                                                   "holds its result (in place of --columns and --filter)")
    serve.add_argument("--advertise", default=None, help="host:port clients reach this node at (default: the bind "
                                                         "host, or this machine's name when it binds 0.0.0.0)")
    serve.add_argument("--peers", default=None, help="comma-separated host:port of every node, in shard order (this "
                                                     "one too): any node then answers for the whole table")
    serve.add_argument("--health-port", type=int, default=None, help="serve HTTP GET /ready on this port "
                                                                     "(Kubeflow's cache uses 8080)")
    serve.add_argument("--data-port", type=_data_port, default=0,
                       help="the data plane's port (datacache.wire: steps as Arrow IPC over plain TCP, beside "
                            "Flight); 0: a free one (the default); off: Flight only. None under TLS")
    serve.add_argument("--batch-bytes", type=_bytes, default=8 << 20, help="record batch size (default 8MiB)")
    _add_token(serve)
    serve.add_argument("--tls-cert", default=None)
    serve.add_argument("--tls-key", default=None)
    for name in ("stat", "ready"):
        p = sub.add_parser(name, help={"stat": "print a node's rows, bytes, schema and shard",
                                       "ready": "exit 0 when the node answers its health check"}[name])
        p.add_argument("endpoint", type=_endpoint)
        _add_token(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    token = _token(args, parser)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][datacache][%(levelname)s] %(message)s")

    if args.command == "serve":
        keep_gathered_buffers()
        if bool(args.tls_cert) != bool(args.tls_key):
            parser.error("--tls-cert and --tls-key go together")
        if args.tls_cert:
            _check_tls(parser, args.tls_cert, args.tls_key)
        if args.port:
            _check_listen(parser, args.host, args.port)
        if args.data_port:
            if args.data_port == args.port:
                parser.error(f"--data-port {args.data_port}: the same as --port; give another, or 0 for a free one")
            _check_listen(parser, args.host, args.data_port, "--data-port")
        scheme = "grpc+tls" if args.tls_cert else "grpc+tcp"
        try:
            server = CacheServer(args.source, f"{scheme}://{args.host}:{args.port}", shard=args.shard[0],
                                 num_shards=args.shard[1], columns=args.columns.split(",") if args.columns else None,
                                 row_filter=args.filter, batch_bytes=args.batch_bytes, token=token,
                                 tls_cert=args.tls_cert, tls_key=args.tls_key, advertise=args.advertise,
                                 peers=args.peers.split(",") if args.peers else None, health_port=args.health_port,
                                 sql=args.sql, data_port=args.data_port)
        except DataCacheError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except pa.ArrowException as e:  # Flight could not start (the address was taken meanwhile)
            print(f"error: --host {args.host} --port {args.port}: the node could not start: "
                  f"{str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        if server.health:
            logging.info("readiness: GET http://%s:%d/ready", args.host, server.health.port)
        print(f"serving on {server.location}", flush=True)
        server.serve()
        return 0

    client = flight.FlightClient(args.endpoint)
    try:
        if args.command == "ready":
            result = next(iter(client.do_action(flight.Action("health", b""), _options(token))))
            return 0 if result.body.to_pybytes() == b"ok" else 1
        result = next(iter(client.do_action(flight.Action("stats", b""), _options(token))))
        stats = json.loads(result.body.to_pybytes())
        print(json.dumps(stats, indent=2))
        return 0
    except (flight.FlightError, pa.ArrowException) as e:
        print(f"error: {args.endpoint}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
