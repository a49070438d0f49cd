"""`python -m trainjob.runtimes.torch_distributed.rendezvous HOST:PORT [--run-dir DIR]`: an elastic job's rendezvous
store, hosted apart from its nodes so that losing any node (node 0 included) leaves the store, and the nodes left
re-form. It imports torch when it serves: nothing imports it, a launcher runs it as `python -m`
(`TorchDistributed.store_command`).

Each node's torchrun joins it as a client (`is_host=false`). Started by every local node's driver: the first
binds the port, the others find it taken and leave it to that one. With `--run-dir` it ends once no node of
the run holds a node slot there (`<run_dir>/.node-<i>.lock`, `RunDir.node_slots`); without, it runs until
stopped (a Docker job removes its container with the job).
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from datetime import timedelta

from trainjob.cli import OneLineParser
from trainjob.run_files import RunDir

POLL_S = 1.0


def nodes_alive(run_dir: str) -> bool:
    """Whether a node of the run in `run_dir` still holds its slot (the kernel drops a dead process's locks)."""
    for path in RunDir.of(run_dir).node_slots():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def serve(host: str, port: int, run_dir: str | None) -> int:
    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    except (RuntimeError, OSError) as e:  # the port is taken: another node's driver hosts the store
        print(f"rendezvous store at {host}:{port} not started here: {e}", file=sys.stderr)
        return 0
    print(f"rendezvous store serving at {host}:{port}", flush=True)
    while run_dir is None or nodes_alive(run_dir):
        time.sleep(POLL_S)
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m trainjob.runtimes.torch_distributed.rendezvous",
                      description=__doc__.splitlines()[0])
    p.add_argument("endpoint", help="HOST:PORT to serve at")
    p.add_argument("--run-dir", help="end once no node of this run directory holds its slot")
    args = p.parse_args(argv)
    host, _, port = args.endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        p.error(f"endpoint={args.endpoint!r}: must be HOST:PORT with a port in 1-65535")
    return serve(host, int(port), args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
