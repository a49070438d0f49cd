"""Seconds from a node's death to the next training step on the nodes left, for an elastic run
(`runtime.nnodes=1:2`), phase by phase, and from SIGTERM to exit (bench/preemption.py's measure).

Starts two nodes of `python -m trainer` on loopback (the `debug` model unless overridden), each the same
command, waits for `--after` steps at world size 2, SIGKILLs one node's torchrun agent (its ranks die with
it), and measures until the survivor logs a step at world size 1. The phases, from the survivor's agent log
and its rank's log: detection (its agent sees its rank fail), the rendezvous (the dead node's heartbeats
missed for `runtime.keep_alive_interval` x `runtime.keep_alive_max_attempt` s, then
`runtime.reform_last_call_timeout`), the new rank's start and imports, its process group, input checks and
model, its data and checkpoint load, and its first step. Prints a table row per mode and phase.
Goals: under 8 s from death to step, under 10 s from SIGTERM to exit.

    python bench/elastic.py [--after 5] [--repeats 3] [override ...]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
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


# The phases of a recovery, in order: each ends at the point named (seconds since the epoch).
PHASES = (("detection: the survivor's agent sees its rank fail", "failed"),
          ("rendezvous: the nodes left re-form", "formed"),
          ("the new rank's process start and imports", "imports_done"),
          ("its process group, input checks and model", "model"),
          ("its data and checkpoint load", "resumed"),
          ("its first step", "step"))
AGENT_LINE = re.compile(r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d+) .*?\] (.*)$")  # torch's glog-style lines
RANK_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\]\[[^]]*\]\[\w+\] (.*)$")


def _agent_times(path: str, after: float) -> dict[str, float]:
    """When the survivor's agent (its output in `path`) saw its rank fail and when it re-formed, after `after`."""
    year = datetime.date.today().year
    found: dict[str, float] = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = AGENT_LINE.match(line)
            if not m:
                continue
            at = datetime.datetime.strptime(f"{year}{m[1]}", "%Y%m%d %H:%M:%S.%f").timestamp()
            if at < after:
                continue
            if "failed (exitcode" in m[2] or "Worker group FAILED" in m[2]:
                found.setdefault("failed", at)
            elif "Rendezvous complete" in m[2] and "failed" in found:
                found.setdefault("formed", at)
    return found


def _rank_times(path: str, after: float) -> dict[str, float]:
    """When the survivor's new rank (its log in `path`) had imported, built its model and resumed."""
    found: dict[str, float] = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = RANK_LINE.match(line.rstrip("\n"))
            if not m:
                continue
            at = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at < after:
                continue
            if m[2].startswith("startup "):
                found.setdefault("imports_done", json.loads(m[2].split(" ", 1)[1])["imports_done"])
            elif m[2].startswith("model ") and "imports_done" in found:
                found.setdefault("model", at)
            elif m[2].startswith("resumed from ") and "model" in found:
                found.setdefault("resumed", at)
    return found


def node_loss(args: list[str], after: int) -> dict[str, float]:
    """Seconds from SIGKILL of one node's agent to the survivor's next logged step ("total"), and to the end of
    each phase (`PHASES`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        run_dir = os.path.join(root, "run")
        command = [sys.executable, "-m", "trainer", *args, "runtime.nnodes=1:2",
                   f"runtime.rdzv_endpoint=127.0.0.1:{port}", f"hydra.run.dir={run_dir}"]
        env = {**os.environ, "LOGLEVEL": "INFO"}  # torchrun's agent says when it re-formed
        outs = [os.path.join(root, f"node-{i}.out") for i in range(2)]
        with contextlib.ExitStack() as files:
            nodes = [subprocess.Popen(command, cwd=REPO, stdout=files.enter_context(open(out, "w")),
                                      stderr=subprocess.STDOUT, env=env) for out in outs]
        try:
            _until(nodes, lambda: sum(r.get("world_size") == 2 for r in read_metrics(run_dir)) >= after, "two nodes")
            died = time.time()
            os.kill(_agent(run_dir), signal.SIGKILL)
            _until(nodes, lambda: any(r.get("world_size") == 1 for r in read_metrics(run_dir)), "a step on one node")
            stepped = time.time()
        finally:
            for node in nodes:
                node.kill()
                node.wait()
        times = max((_agent_times(out, died) for out in outs), key=len)
        times.update(_rank_times(os.path.join(run_dir, "logs", "rank-0.log"), died), step=stepped)
        return {"total": stepped - died, **{key: times[key] - died for _, key in PHASES if key in times}}


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
    losses = [node_loss(base, a.after) for _ in range(a.repeats)]
    deaths = [loss["total"] for loss in losses]
    print(f"| node death to next step on the survivor | {statistics.median(deaths):.2f} | {min(deaths):.2f} | "
          f"{max(deaths):.2f} | < 8 |", flush=True)
    ended = [0.0] * len(losses)
    for phase, key in PHASES:  # each phase's seconds: from the end of the one before to its own end
        spans = [loss[key] - ended[i] for i, loss in enumerate(losses) if key in loss]
        ended = [loss.get(key, ended[i]) for i, loss in enumerate(losses)]
        if spans:
            print(f"| - {phase} | {statistics.median(spans):.2f} | {min(spans):.2f} | {max(spans):.2f} | |",
                  flush=True)
    stops = [measure([*base, "runtime.nnodes=1"], True, a.after)[0] for _ in range(a.repeats)]
    print(f"| SIGTERM to exit (torchrun, 1 rank) | {statistics.median(stops):.2f} | {min(stops):.2f} | "
          f"{max(stops):.2f} | < 10 |", flush=True)


if __name__ == "__main__":
    main()
