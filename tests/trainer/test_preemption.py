"""SIGTERM is a preemption notice (Kubernetes, `docker stop`, torchrun's agent): the ranks finish the step in
flight, write a checkpoint, exit with 143, and the same command resumes to the uninterrupted run's losses bit
for bit. Real processes and signals: the driver training in its own process, and torchrun's agent with two
ranks on gloo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import TINY, read_metrics, read_summary
from trainjob.run_files import read_events

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
ARGS = [*TINY, "train.max_steps=40", "train.eval_every=20", "train.checkpoint_every=1000"]


def _start(cache_dir: str, cwd, *args: str) -> subprocess.Popen:
    env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=str(cwd), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(run_dir, proc: subprocess.Popen, steps: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(read_metrics(str(run_dir))) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {steps} steps in {run_dir}: {proc.poll()} {proc.stderr and proc.stderr.read()}")


def _torchrun_agent(run_dir) -> int:
    """The pid of the torchrun agent of the run in `run_dir`."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"trainjob.runtimes.torch_distributed.torchrun" in argv and str(run_dir).encode() in b" ".join(argv):
            return int(pid)
    raise AssertionError(f"no torchrun agent for {run_dir}")


def _resumed_equals_reference(cache_dir, tmp_path, run_dir, args, reference) -> None:
    proc = _start(cache_dir, tmp_path, *args, f"hydra.run.dir={run_dir}")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    ours, ref = read_summary(str(run_dir)), read_summary(str(reference))
    assert (ours["final_train_loss"], ours["final_eval_loss"]) == (ref["final_train_loss"], ref["final_eval_loss"])
    assert [m["loss"] for m in read_metrics(str(run_dir))] == [m["loss"] for m in read_metrics(str(reference))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("preemption-reference")
    proc = _start(cache_dir, root, *ARGS, f"hydra.run.dir={root / 'run'}")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return root / "run"


# train.checkpoint_async: the checkpoint of the step in flight is written in the background, and waited for.
@pytest.mark.parametrize("extra", [[], ["train.checkpoint_async=true"]], ids=["sync", "async"])
@pytest.mark.e2e
def test_sigterm_checkpoints_the_step_in_flight_exits_143_and_resumes_bit_for_bit(reference, cache_dir, tmp_path,
                                                                                  extra):
    run_dir = tmp_path / "run"
    proc = _start(cache_dir, tmp_path, *ARGS, *extra, f"hydra.run.dir={run_dir}")
    _wait_for_steps(run_dir, proc, 5)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert time.monotonic() - signalled < 30
    (line,) = [x for x in err.splitlines() if x.startswith("preempted")]
    step = len(read_metrics(str(run_dir)))
    assert 5 <= step < 40
    assert line == (f"preempted (SIGTERM): checkpoint of step {step} written to "
                    f"{run_dir / 'checkpoints' / f'step-{step}'}; the same command resumes from it")
    assert os.listdir(run_dir / "checkpoints") == [f"step-{step}"]
    _resumed_equals_reference(cache_dir, tmp_path, run_dir, ARGS, reference)
    # The events have a file of their own: metrics.jsonl holds each logged step once.
    assert [m["step"] for m in read_metrics(str(run_dir))] == list(range(1, 41))
    assert [(e["event"], e.get("at_step"), e.get("resumed_from_step")) for e in read_events(str(run_dir))] == [
        ("preemption", step, None), ("resume", None, step)]
    assert not any("event" in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())


@pytest.mark.e2e
def test_sigterm_to_torchruns_agent_stops_both_ranks_after_one_step_and_resumes(cache_dir, tmp_path):
    args = [*ARGS, "+runtime=torch-distributed", "runtime.nproc_per_node=2"]
    whole = tmp_path / "whole"
    proc = _start(cache_dir, tmp_path, *args, f"hydra.run.dir={whole}")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    run_dir = tmp_path / "run"
    proc = _start(cache_dir, tmp_path, *args, f"hydra.run.dir={run_dir}")
    _wait_for_steps(run_dir, proc, 5)
    os.kill(_torchrun_agent(run_dir), signal.SIGTERM)  # as Kubernetes signals a pod's first process
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    logs = [(run_dir / "logs" / f"rank-{r}.log").read_text() for r in (0, 1)]
    step = len(read_metrics(str(run_dir)))
    assert all(f"checkpoint of step {step} written" in log or "SIGTERM" in log for log in logs)
    assert os.listdir(run_dir / "checkpoints") == [f"step-{step}"]
    _resumed_equals_reference(cache_dir, tmp_path, run_dir, args, whole)
