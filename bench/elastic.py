"""Seconds from a node's death to the next training step on the nodes left, for an elastic run
(`runtime.nnodes=1:2`), and from SIGTERM to exit (bench/preemption.py's measure).

Starts two nodes of `python -m trainer` on loopback (the `debug` model unless overridden), each the same
command, waits for `--after` steps at world size 2, SIGKILLs one node's torchrun agent (its ranks die with
it), and measures until the survivor logs a step at world size 1: the heartbeat timeout, the rendezvous'
last call (`runtime.last_call_timeout`), the restart and the checkpoint load. Prints a table row per mode.
Goals: under 30 s from death to step, under 10 s from SIGTERM to exit.

    python bench/elastic.py [--after 5] [--repeats 3] [override ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from preemption import REPO, _agent, measure

from trainjob.run_files import read_metrics


def _until(procs: list[subprocess.Popen], ok, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what}: not reached")
        time.sleep(0.02)


def node_loss(args: list[str], after: int) -> float:
    """Seconds from SIGKILL of one node's agent to the survivor's next logged step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        run_dir = os.path.join(root, "run")
        command = [sys.executable, "-m", "trainer", *args, "runtime.nnodes=1:2",
                   f"runtime.rdzv_endpoint=127.0.0.1:{port}", f"hydra.run.dir={run_dir}"]
        nodes = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for _ in range(2)]
        try:
            _until(nodes, lambda: sum(r.get("world_size") == 2 for r in read_metrics(run_dir)) >= after, "two nodes")
            died = time.monotonic()
            os.kill(_agent(run_dir), signal.SIGKILL)
            _until(nodes, lambda: any(r.get("world_size") == 1 for r in read_metrics(run_dir)), "a step on one node")
            return time.monotonic() - died
        finally:
            for node in nodes:
                node.kill()
                node.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", type=int, default=5, help="steps at world size 2 before a node dies")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    a = parser.parse_args()
    base = ["train.max_steps=100000", "train.log_every=1", "train.progress=false", "train.eval_every=1000000",
            "train.checkpoint_every=1", "+runtime=torch-distributed", "runtime.nproc_per_node=1",
            "runtime.max_restarts=3", *a.overrides]
    print("| event | seconds (median) | min | max | goal |")
    print("|---|---|---|---|---|")
    deaths = [node_loss(base, a.after) for _ in range(a.repeats)]
    print(f"| node death to next step on the survivor | {statistics.median(deaths):.2f} | {min(deaths):.2f} | "
          f"{max(deaths):.2f} | < 30 |", flush=True)
    stops = [measure([*base, "runtime.nnodes=1"], True, a.after)[0] for _ in range(a.repeats)]
    print(f"| SIGTERM to exit (torchrun, 1 rank) | {statistics.median(stops):.2f} | {min(stops):.2f} | "
          f"{max(stops):.2f} | < 10 |", flush=True)


if __name__ == "__main__":
    main()
