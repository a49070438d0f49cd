"""`python -m trainjob.runtimes.function.procs --count N --index NAME [--env K=V ...] -- COMMAND...`: the agent of a
runtime whose nodes each run one process that its framework joins by itself (JAX, XGBoost), when the job's "nodes" are
processes on this machine: start COMMAND N times, process i with NAME=i (JAX_PROCESS_ID, DMLC_TASK_ID) and the
`--env` values set, and wait. When one ends with a failure the others are stopped (their framework would wait
for it forever) and this exits with that process's code (a signal: 128 + its number); SIGTERM is passed on.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from trainjob.cli import OneLineParser

GRACE_S = 10.0


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(count: int, index: str, env: dict[str, str], command: list[str]) -> int:
    procs = [subprocess.Popen(command, env={**os.environ, **env, index: str(i)}) for i in range(count)]
    signal.signal(signal.SIGTERM, lambda *_: [p.send_signal(signal.SIGTERM) for p in procs if p.poll() is None])
    while True:
        codes = [p.poll() for p in procs]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            _stop(procs)
            return _code(failed)
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m trainjob.runtimes.function.procs",
                      description="Start a command once per node on this machine.")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--index", required=True, help="the variable holding each process's index")
    p.add_argument("--env", action="append", default=[], help="K=V set for every process")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.count < 1 or not command:
        p.error("--count must be >= 1 and a command given after --")
    return run(args.count, args.index, dict(e.split("=", 1) for e in args.env), command)


if __name__ == "__main__":
    sys.exit(main())
