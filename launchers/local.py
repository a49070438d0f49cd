"""The local launcher: without a runtime the worker runs in this process (world size 1, through a real
one-rank process group); with `+runtime=torch-distributed` it runs under real torchrun processes. A run's
data cache nodes (`data.cache.nodes`) start first, as processes on loopback that die with this one, and
stop when the run ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from launchers.base import (
    TORCHRUN_ENV,
    Job,
    JobState,
    Launcher,
    LauncherError,
    Run,
    torchrun_args,
    worker_command,
)

READY_TIMEOUT = 600.0  # a node builds the corpus before it serves


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CacheNodeProcesses:
    """The run's data cache nodes as processes on loopback, each in a session of its own that dies with
    this process; logs in `<run_dir>/logs/cache-node-<i>.log`. `env` names them for the ranks."""

    def __init__(self, run: Run):
        spec = run.cache_nodes
        self.procs: list[subprocess.Popen] = []
        self.logs = [os.path.join(run.run_dir, "logs", f"cache-node-{i}.log") for i in range(spec.count)]
        os.makedirs(os.path.dirname(self.logs[0]), exist_ok=True)
        env = {**os.environ, **run.secrets}
        train, eval_ = [], []
        for i in range(spec.count):
            port, eval_port = _free_port(), _free_port()
            with open(self.logs[i], "ab") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, *spec.argv(run.config_path, i, "127.0.0.1", port, eval_port)], stdout=log,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_die_with_parent))
            train.append(f"grpc://127.0.0.1:{port}")
            if i == 0:
                eval_.append(f"grpc://127.0.0.1:{eval_port}")
        self.env = spec.env(train, eval_)
        try:
            self._wait_ready([(i, e) for i, e in enumerate(train)] + [(0, e) for e in eval_], env)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, endpoints: list[tuple[int, str]], env: dict[str, str]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        for i, endpoint in endpoints:
            while True:
                code = self.procs[i].poll()
                if code is not None:
                    with open(self.logs[i]) as f:
                        tail = " | ".join(f.read().strip().splitlines()[-3:])
                    raise LauncherError(f"cache node {i} exited with code {code} before serving ({self.logs[i]}): "
                                        f"{tail}")
                ready = subprocess.run([sys.executable, "-m", "datacache", "ready", endpoint], env=env,
                                       capture_output=True, timeout=60)
                if ready.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise LauncherError(f"cache node {i} at {endpoint} not ready after {READY_TIMEOUT:.0f} s")
                time.sleep(0.5)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class InProcessJob(Job):
    """Runs the worker to completion inside `launch`; by the time the caller has the handle, it is done."""

    def __init__(self, run: Run):
        self.run, self.name = run, os.path.basename(run.run_dir)
        from omegaconf import OmegaConf

        from trainer import worker

        nodes = CacheNodeProcesses(run) if run.cache_nodes else None
        os.environ.update({**run.secrets, **(nodes.env if nodes else {})})  # the config reads them
        try:
            worker.run(OmegaConf.create(run.config))
            self._state = JobState.SUCCEEDED
        except BaseException:
            self._state = JobState.FAILED
            raise
        finally:
            if nodes:
                nodes.stop()

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
        self._nodes = CacheNodeProcesses(run) if run.cache_nodes else None
        env = {**os.environ, **TORCHRUN_ENV, **run.secrets, **(self._nodes.env if self._nodes else {})}
        # A session of its own, so that cancel() can stop torchrun and every rank it started.
        self._proc = subprocess.Popen(command, start_new_session=True, env=env, preexec_fn=_die_with_parent)
        self._cancelled = False

    def status(self) -> JobState:
        code = self._proc.poll()
        if code is None:
            return JobState.RUNNING
        if self._nodes:  # the run has ended: its cache nodes go with it
            self._nodes.stop()
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
        if self._proc.poll() is None:
            self._cancelled = True
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if self._nodes:
            self._nodes.stop()


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
