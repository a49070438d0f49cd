"""One trial of an Optuna sweep as a process: `python -m trainer <overrides> hydra.run.dir=<sweep>/<n>` with
the command's launcher, in a process group of its own and on its share of this machine's CPUs; watched through
the launcher's `Client` (its job, found by its run directory or, on Kubernetes, by the name it was given; its
metrics as the run logs them, `get_job_metrics`: on Kubernetes where launcher.local_run_root mounts the pods' run
directories); and stopped, when the pruner says so, with every process it started gone and its job deleted
through the Client. Its driver's exit code says how it ended (2: a config the trainer refused)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import yaml

from launchers import Client, LauncherError
from launchers.options import offers
from trainjob import process_tree
from trainjob.run_files import RunDir, write_event

PR_SET_PDEATHSIG = 1
# What a launcher that cannot answer (yet) raises: the trial is watched again at the next poll.
UNANSWERED = (LauncherError, OSError)


def cpu_shares(n_jobs: int) -> list[set[int]]:
    """The CPUs this process may use, split into `n_jobs` shares (each all of them where there are fewer)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n_jobs:
        return [set(cpus)] * n_jobs
    return [set(cpus[i * len(cpus) // n_jobs : (i + 1) * len(cpus) // n_jobs]) for i in range(n_jobs)]


def job_name(sweep_dir: str, number: int) -> str:
    """A Kubernetes trial's TrainJob name: unique per sweep directory and trial, an RFC 1035 label."""
    return f"tj-sweep-{hashlib.sha256(os.path.abspath(sweep_dir).encode()).hexdigest()[:8]}-{number}"


class TrialProcess:
    """Trial `number`'s driver, started by `start()`."""

    def __init__(self, number: int, overrides: list[str], sweep_dir: str, launcher: Any, cpus: set[int] | None):
        self.number, self.cpus, self.launcher = number, cpus, launcher
        self.run_dir = os.path.abspath(os.path.join(sweep_dir, str(number)))
        self.overrides = [*overrides, f"hydra.run.dir={self.run_dir}"]
        self.metrics_dir, self.job_name = self.run_dir, None
        if not offers(launcher).reads_disk_here:  # the pods write to shared storage, mounted here
            self.job_name = job_name(sweep_dir, number)
            self.overrides.append(f"launcher.job_name={self.job_name}")
            root = os.path.expanduser(launcher["local_run_root"])
            self.metrics_dir = os.path.abspath(os.path.join(root, self.job_name))
        self.log = os.path.join(sweep_dir, "trial-logs", f"{number}.log")
        self.proc: subprocess.Popen | None = None
        self.reported = -1  # the last step whose value the study has
        self._max_steps: int | None = None
        self._client: Client | None = None

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.cpus is not None:
            env.setdefault("OMP_NUM_THREADS", str(len(self.cpus)))
        cpus = self.cpus

        def in_child() -> None:  # before exec: its CPUs, and its end with the sweep's (killed outright too)
            if cpus:
                os.sched_setaffinity(0, cpus)
            if sys.platform == "linux":
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer", *self.overrides],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=in_child,
            )

    def poll(self) -> int | None:
        return self.proc.poll()

    def client(self) -> Client:
        """The Client of the trial's launcher, with the options that find its jobs."""
        if self._client is None:
            keys = ("namespace", "kubeconfig", "context", "run_claim", "local_run_root")
            self._client = Client(self.launcher["name"], **{k: self.launcher[k] for k in keys if self.launcher.get(k)})
        return self._client

    def job(self) -> str | None:
        """The trial's job on its launcher: the name it was given, or the job whose run directory is the trial's
        (None until its driver has put it on record). Looked for once the driver has saved the run's config,
        which it does before it launches: a Client lists every job it has on record."""
        if self.job_name is None and os.path.exists(RunDir.of(self.run_dir).config):
            with contextlib.suppress(*UNANSWERED):
                self.job_name = next((j.name for j in self.client().list_jobs()
                                      if j.run_dir and os.path.abspath(j.run_dir) == self.run_dir), None)
        return self.job_name

    def records(self) -> list[dict[str, Any]]:
        """What the trial's run has logged so far (`Client.get_job_metrics`; nothing before its job exists)."""
        name = self.job()
        with contextlib.suppress(*UNANSWERED):
            return self.client().get_job_metrics(name) if name else []
        return []

    def new_values(self, metric: str) -> list[tuple[int, float]]:
        """(step, value) of `metric` on the lines written since the last call."""
        values = [
            (int(r["step"]), float(r[metric]))
            for r in self.records()
            if metric in r and "step" in r and int(r["step"]) > self.reported
        ]
        if values:
            self.reported = values[-1][0]
        return values

    def max_steps(self) -> int | None:
        """train.max_steps of the config.yaml the trial's driver saved (None until it is saved)."""
        if self._max_steps is None:
            with (
                contextlib.suppress(OSError, yaml.YAMLError, KeyError, TypeError),
                open(RunDir.of(self.run_dir).config) as f,
            ):
                self._max_steps = int(yaml.safe_load(f)["train"]["max_steps"])
        return self._max_steps

    def final(self, metric: str) -> float | None:
        """The run's last value of `metric` (eval_loss: the job's, its summary's final eval loss)."""
        name = self.job()
        if metric == "eval_loss" and name:
            with contextlib.suppress(*UNANSWERED):
                if (value := self.client().get_job(name).eval_loss) is not None:
                    return float(value)
        values = [float(r[metric]) for r in self.records() if metric in r]
        return values[-1] if values else None

    def steps(self) -> int | None:
        records = self.records()
        return int(records[-1]["step"]) if records else None

    def prune(self, step: int, metric: str, value: float) -> None:
        """Stop the trial: its run directory says so (events.jsonl: pruned, at_step), then every process it
        started is killed (no checkpoint is written) and its containers or TrainJob deleted."""
        write_event(self.metrics_dir, "pruned", at_step=step, metric=metric, value=value)
        self.kill()

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for pid in [self.proc.pid, *process_tree.descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        if not offers(self.launcher).runs_here:  # containers, TrainJobs: they outlive the driver's processes
            self._delete_job()

    def _delete_job(self) -> None:
        """The trial's job on its launcher, deleted through the Client. A launcher that cannot say or do it leaves
        it (the trial is pruned or failed whatever it answers)."""
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            if name := self.job():
                self.client().delete_job(name)

    def error_line(self) -> str:
        """The last line the trial's driver printed (its error), or where its log is."""
        try:
            with open(self.log, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            lines = []
        return lines[-1] if lines else f"no output (see {self.log})"


def wait_any(trials: list[TrialProcess], poll_s: float) -> None:
    """Sleep `poll_s`, or less when a trial ends."""
    deadline = time.monotonic() + poll_s
    while time.monotonic() < deadline and all(t.poll() is None for t in trials):
        time.sleep(0.05)
