"""One data cache node of a run (`data.cache.nodes=N`), started by the run's launcher beside its ranks:

    python -m trainer.data.cache_node <config.yaml> --shard i/N --host H --port P [--eval-port Q]

It builds the run's corpus (or finds it in `data.cache_dir`), then serves shard i of N of its training rows
on port P, and with `--eval-port` all of its eval rows on port Q, over Arrow Flight until it is stopped.
The token, if any, comes from TRAINJOB_CACHE_TOKEN, as for the ranks. Where the launcher gives the nodes
the endpoint list it gives the ranks (`data.cache.endpoints`, on Kubernetes the pods' stable names), node i
advertises entry i and lists all of them as its peers, so that any node answers a Kubeflow client
(`datacache.kubeflow`) for the whole table.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # before the imports below, which the restart repeats
    from trainjob.allocator import restart_with_huge_pages

    restart_with_huge_pages()

import logging
import os
import signal
import threading

from omegaconf import OmegaConf

from datacache.server import CacheServer, DataCacheError, keep_gathered_buffers
from trainer.data.corpus import prepare
from trainer.errors import ConfigError
from trainjob.cli import OneLineParser
from trainjob.env import CACHE_TOKEN_ENV


def _peers(cfg, count: int) -> list[str] | None:
    """Every node's host:port in shard order, from the endpoints the launcher gave the run (None where it gave
    this node none, or not one per node)."""
    endpoints = OmegaConf.select(cfg, "data.cache.endpoints", default=None, throw_on_resolution_failure=False)
    if endpoints is None or len(endpoints) != count:
        return None
    return [str(e).split("://", 1)[-1] for e in endpoints]


def _servers(cfg, args, index: int, count: int) -> list[CacheServer]:
    """The node's servers: shard `index` of `count` of the training rows, and with --eval-port the eval rows."""
    corpus = prepare(cfg.data)
    token = os.environ.get(CACHE_TOKEN_ENV) or None
    peers = _peers(cfg, count)
    if peers:
        logging.info("peers (for Kubeflow clients, which may ask any node for the whole table): %s", ", ".join(peers))
    # Each with a data plane on a free port (datacache.wire), which the ranks learn from the node.
    servers = [CacheServer(os.path.join(corpus, "train"), f"grpc://{args.host}:{args.port}", shard=index,
                           num_shards=count, token=token, advertise=peers[index] if peers else None, peers=peers,
                           data_port=0)]
    if args.eval_port is not None:
        servers.append(CacheServer(os.path.join(corpus, "eval"), f"grpc://{args.host}:{args.eval_port}",
                                   token=token, data_port=0))
    return servers


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.data.cache_node", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the run's resolved config.yaml")
    parser.add_argument("--shard", required=True, help="i/N: serve the i-th of N parts of the training rows")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--eval-port", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        index, count = (int(x) for x in args.shard.split("/"))
    except ValueError:
        parser.error(f"--shard {args.shard!r}: give it as i/N, for example 0/2")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][cache-node][%(levelname)s] %(message)s")
    keep_gathered_buffers()
    try:
        servers = _servers(OmegaConf.load(args.config), args, index, count)
    except (DataCacheError, ConfigError) as e:  # a damaged corpus file, a source that cannot be built: one line
        print(f"error: {e}", file=sys.stderr)
        return 2

    def stop(*_):
        for server in servers:
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    threads = [threading.Thread(target=server.serve) for server in servers]
    for thread in threads:
        thread.start()
    print(f"serving {', '.join(s.location for s in servers)}", flush=True)
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
