"""Seconds from SIGTERM to exit, and to the next step after relaunching, for a preempted run.

Starts `python -m trainer` (the `debug` model unless overridden), waits for `--after` logged steps, sends
SIGTERM (to the driver in this process, or to torchrun's agent with `--nproc` ranks, as Kubernetes signals a
pod's first process), and measures until the processes are gone and the checkpoint is written; then relaunches
the same command and measures until its first new step is logged. Prints one table row per mode.

    python bench/preemption.py [--nproc 2] [--after 5] [--repeats 3] [override ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
from trainjob.run_files import read_metrics  # noqa: E402


def _lines(run_dir: str) -> int:
    return len(read_metrics(run_dir))


def _agent(run_dir: str) -> int:
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"trainjob.runtimes.torch_distributed.torchrun" in argv and run_dir.encode() in b" ".join(argv):
            return int(pid)
    raise RuntimeError(f"no torchrun agent for {run_dir}")


def _start(args: list[str], run_dir: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *args, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait(proc: subprocess.Popen, run_dir: str, lines: int) -> None:
    while _lines(run_dir) < lines:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended ({proc.returncode}) before step {lines}: {proc.stderr.read()[-500:]}")
        time.sleep(0.02)


def measure(args: list[str], torchrun: bool, after: int) -> tuple[float, float, int]:
    """(SIGTERM to exit s, relaunch to its first new step s, the driver's exit code)."""
    with tempfile.TemporaryDirectory() as root:
        run_dir = os.path.join(root, "run")
        proc = _start(args, run_dir)
        _wait(proc, run_dir, after)
        target = _agent(run_dir) if torchrun else proc.pid
        signalled = time.monotonic()
        os.kill(target, signal.SIGTERM)
        while True:  # the driver, then every process of the run (torchrun's agent and its ranks)
            if proc.poll() is not None and not any(_alive(p) for p in [target]):
                break
            time.sleep(0.01)
        to_exit = time.monotonic() - signalled
        stopped = _lines(run_dir)
        relaunched = time.monotonic()
        again = _start(args, run_dir)
        _wait(again, run_dir, stopped + 1)
        to_step = time.monotonic() - relaunched
        again.kill()
        again.wait()
        return to_exit, to_step, proc.returncode


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--after", type=int, default=5, help="logged steps before SIGTERM")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    a = parser.parse_args()
    base = ["train.max_steps=10000", "train.log_every=1", "train.progress=false", "train.eval_every=100000",
            "train.checkpoint_every=100000", *a.overrides]
    modes = [("in process", base, False),
             (f"torchrun x{a.nproc}", [*base, "+runtime=torch-distributed", f"runtime.nproc_per_node={a.nproc}"], True)]
    print("| mode | SIGTERM to exit, s (median) | relaunch to next step, s (median) | exit code |")
    print("|---|---|---|---|")
    for name, args, torchrun in modes:
        runs = [measure(args, torchrun, a.after) for _ in range(a.repeats)]
        print(f"| {name} | {statistics.median(r[0] for r in runs):.2f} | {statistics.median(r[1] for r in runs):.2f}"
              f" | {json.dumps(sorted({r[2] for r in runs}))} |", flush=True)


if __name__ == "__main__":
    main()
