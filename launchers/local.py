"""The local launcher: without a runtime the worker runs in this process (world size 1, through a real
one-rank process group); with `+runtime=torch-distributed` it runs under real torchrun processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from launchers.base import TORCHRUN_ENV, Job, JobState, Launcher, Run, torchrun_args, worker_command


def _rank_log(run: Run, rank: int) -> str:
    return os.path.join(run.run_dir, "logs", f"rank-{rank}.log")


def _read_log(path: str, follow: bool, finished) -> Iterator[str]:
    while follow and not os.path.exists(path) and not finished():
        time.sleep(0.2)
    if not os.path.exists(path):
        return
    with open(path) as f:
        while True:
            line = f.readline()
            if line:
                yield line.rstrip("\n")
            elif follow and not finished():
                time.sleep(0.2)
            else:
                return


class InProcessJob(Job):
    """Runs the worker to completion inside `launch`; by the time the caller has the handle, it is done."""

    def __init__(self, run: Run):
        self.run, self.name = run, os.path.basename(run.run_dir)
        from omegaconf import OmegaConf

        from trainer import worker

        os.environ.update(run.secrets)  # the config refers to them as ${oc.env:...}
        try:
            worker.run(OmegaConf.create(run.config))
            self._state = JobState.SUCCEEDED
        except BaseException:
            self._state = JobState.FAILED
            raise

    def status(self) -> JobState:
        return self._state

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        return _read_log(_rank_log(self.run, rank), follow=False, finished=lambda: True)

    def wait(self, timeout: float | None = None) -> JobState:
        return self._state

    def cancel(self) -> None:
        """Nothing to cancel: the run finished inside `launch`."""


def _die_with_parent() -> None:
    """In the child before exec: on Linux, have the kernel send SIGTERM when the driver dies, so that a
    driver killed outright (SIGKILL) does not leave torchrun and its ranks running."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class TorchrunJob(Job):
    def __init__(self, run: Run, command: list[str]):
        self.run, self.name, self.command = run, os.path.basename(run.run_dir), command
        # A session of its own, so that cancel() can stop torchrun and every rank it started.
        self._proc = subprocess.Popen(command, start_new_session=True,
                                      env={**os.environ, **TORCHRUN_ENV, **run.secrets}, preexec_fn=_die_with_parent)
        self._cancelled = False

    def status(self) -> JobState:
        code = self._proc.poll()
        if code is None:
            return JobState.RUNNING
        if self._cancelled:
            return JobState.CANCELLED
        return JobState.SUCCEEDED if code == 0 else JobState.FAILED

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        return _read_log(_rank_log(self.run, rank), follow, lambda: self._proc.poll() is not None)

    def wait(self, timeout: float | None = None) -> JobState:
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        except KeyboardInterrupt:
            self.cancel()
            raise
        return self.status()

    def cancel(self) -> None:
        if self._proc.poll() is not None:
            return
        self._cancelled = True
        os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


class LocalLauncher(Launcher):
    def __init__(self):
        self._jobs: list[Job] = []

    def command(self, run: Run) -> list[str]:
        runtime = run.config.get("runtime")
        if runtime is None:
            return [sys.executable, *worker_command(run.config_path)]
        nproc = run.world_size // runtime["nnodes"]
        return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(runtime, nproc),
                *worker_command(run.config_path)]

    def launch(self, run: Run) -> Job:
        job = InProcessJob(run) if run.config.get("runtime") is None else TorchrunJob(run, self.command(run))
        self._jobs.append(job)
        return job

    def list_jobs(self) -> list[Job]:
        return list(self._jobs)


_LAUNCHER = LocalLauncher()


def make(config: dict) -> LocalLauncher:
    """The one local launcher of this process (it remembers the jobs it started)."""
    return _LAUNCHER
