"""No process outlives the driver: with every core busy (a CPU hog per core), SIGTERM or Ctrl-C to a
`runtime=torch-distributed` driver after its first step, or a rank that fails, ends the driver with its exit
code (143, 130, the rank's) only once its supervisor, torchrun's agent and both ranks are gone. Real processes
and signals; the driver's descendants are read from /proc while it runs (pid and start time, so that a pid used
again is not taken for one of them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import TINY, read_metrics

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
ARGS = [
    *TINY,
    # Far more steps than the test waits for: the signal must reach a driver still training (400 steps of this
    # model ended in 7 s, before a test slowed by the hog had seen the first step).
    "train.max_steps=100000",
    "train.eval_every=1000000",
    "train.checkpoint_every=1000000",
    "+runtime=torch-distributed",
    "runtime.nproc_per_node=2",
]


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of `pid`, None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], fields[19]


def _descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every live process under `root`."""
    table = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p))) is not None}
    found, todo = set(), [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, state, start) in table.items():
            if ppid == parent and state not in "ZX":
                found.add((pid, start))
                todo.append(pid)
    return found


def _rank(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"trainer.worker" in f.read()
    except OSError:
        return False


def _alive(pid: int, start: str) -> bool:
    s = _stat(pid)
    return s is not None and s[2] == start and s[1] not in "ZX"


@pytest.fixture
def cpu_hog():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    yield
    for hog in hogs:
        hog.kill()
        hog.wait()


def _drive(cache_dir, tmp_path, run_dir, *extra: str) -> tuple[subprocess.Popen, set[tuple[int, str]]]:
    """Start the driver; return it, once it has trained a step, with every process seen under it so far."""
    env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    driver = subprocess.Popen(
        [sys.executable, "-m", "trainer", *ARGS, *extra, f"hydra.run.dir={run_dir}"],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal sends it: a suite started in the background by a non-interactive shell (`.ci/run &`)
        # hands its processes SIGINT ignored, which Python then keeps (no KeyboardInterrupt).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen: set[tuple[int, str]] = set()
    deadline = time.monotonic() + 240
    while driver.poll() is None and time.monotonic() < deadline:
        seen |= _descendants(driver.pid)
        if os.path.exists(run_dir / "metrics.jsonl") and read_metrics(str(run_dir)):
            return driver, seen | _descendants(driver.pid)
        time.sleep(0.05)
    raise AssertionError(f"no step in {run_dir}: exit {driver.poll()}, {driver.stderr.read()[-2000:]}")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.e2e
def test_a_signal_to_the_driver_under_a_cpu_hog_leaves_none_of_its_processes(cache_dir, tmp_path, cpu_hog, sig, code):
    run_dir = tmp_path / "run"
    driver, seen = _drive(cache_dir, tmp_path, run_dir)
    ranks = [p for p, _ in seen if _rank(p)]
    assert len(seen) >= 4 and len(ranks) >= 2, seen  # supervisor, torchrun's agent, two ranks
    driver.send_signal(sig)
    err = driver.communicate(timeout=120)[1]
    left = [pid for pid, start in seen if _alive(pid, start)]
    assert left == [], f"still running after the driver's exit: {left}"
    assert driver.returncode == code, err[-3000:]


@pytest.mark.e2e
def test_a_failing_rank_under_a_cpu_hog_leaves_none_of_the_drivers_processes(cache_dir, tmp_path, cpu_hog):
    run_dir = tmp_path / "run"
    driver, seen = _drive(cache_dir, tmp_path, run_dir)
    rank = next(p for p, _ in seen if _rank(p))
    os.kill(rank, signal.SIGKILL)
    err = driver.communicate(timeout=120)[1]
    assert driver.returncode == 1, err[-3000:]
    assert [pid for pid, start in seen if _alive(pid, start)] == []
