"""The local launcher: jobs on this machine. `InProcessLauncher` calls a given callable in this process
(world size 1) and keeps the summary it returns; `LocalLauncher` starts the command as real processes
(under the spec's runtime: torchrun, mpirun), each job under a supervisor (`launchers.supervise`) and on
record in the job registry (`launchers.registry`), so that any process can list, follow, wait for and
delete it. With `launcher.wait=true` (the command line's default) the job dies with the process that
started it; with `wait=false` (the Client's) it runs on after that process ends. A run's data cache nodes
(`data.cache.nodes`) start first, as processes on loopback that die with this one, and stop when the run
ends.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from typing import Any

from launchers import packages, registry
from launchers.backend import Backend, runtime_unit
from launchers.base import (
    Job,
    JobInfo,
    JobState,
    Launcher,
    LauncherError,
    LaunchSpec,
    Step,
    check_step,
    node_command,
    run_name,
    step_ranks,
    store_apart,
)
from trainjob import process_tree
from trainjob.nodes import free_port, local_gpus
from trainjob.run_files import RunDir, read_progress, read_summary
from trainjob.runtimes import Runtime

READY_TIMEOUT = 600.0  # a node builds the corpus before it serves
POLL_S = 0.2


def job_name(spec: LaunchSpec) -> str:
    """The run's name; a node of a run started here once per node is `<name>-node-<i>`."""
    if spec.node is None:
        return run_name(spec.run_dir)
    return f"{run_name(spec.run_dir, 44)}-node-{spec.node}"


def start_rendezvous_store(spec: LaunchSpec) -> None:
    """The rendezvous store of an elastic job, or of nodes started one by one, in a session of its own so that
    it outlives this node: it ends when no node of the run is left (the runtime's `store_command`); when another
    node's store already serves, this one finds the port taken and leaves."""
    log_path = RunDir.of(spec.run_dir).rendezvous_log
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "ab") as log:
        store = subprocess.Popen(
            spec.runtime.unit.store_command(sys.executable, spec.runtime.options["rdzv_endpoint"], spec.run_dir),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    process_tree.detach(store.pid)


def _utc(timestamp: float | None) -> datetime | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, timezone.utc)


def _read_log(path: str, follow: bool, finished: Callable[[], bool]) -> Iterator[str]:
    while follow and not os.path.exists(path) and not finished():
        time.sleep(POLL_S)
    if not os.path.exists(path):
        return
    with open(path, errors="replace") as f:
        while True:
            line = f.readline()
            if line:
                yield line.rstrip("\n")
            elif follow and not finished():
                time.sleep(POLL_S)
            else:
                rest = f.read()  # written between the last read and the end
                if rest:
                    yield from rest.rstrip("\n").split("\n")
                return


def rank_logs(
    run_dir: str, rank: int, follow: bool, finished: Callable[[], bool], console: str | None = None
) -> Iterator[str]:
    """Lines of rank `rank`'s log (`<run_dir>/logs/rank-<r>.log`, which every rank writes); when there is
    none once the job has ended, rank 0 reads the job's `console` (what its processes printed)."""
    path = RunDir.of(run_dir).rank_log(rank)
    yield from _read_log(path, follow, finished)
    if not os.path.exists(path) and rank == 0 and console:
        yield from _read_log(console, False, finished)


class CacheNodeProcesses:
    """The run's data cache nodes as processes on loopback, each in a session of its own that dies with
    this process; logs in `<run_dir>/logs/cache-node-<i>.log`. `env` names them for the ranks."""

    def __init__(self, spec: LaunchSpec):
        nodes = spec.cache_nodes
        self.procs: list[subprocess.Popen] = []
        self.logs = [RunDir.of(spec.run_dir).cache_node_log(i) for i in range(nodes.count)]
        os.makedirs(os.path.dirname(self.logs[0]), exist_ok=True)
        ports = [(free_port(), free_port()) for _ in range(nodes.count)]
        train = [f"grpc://127.0.0.1:{port}" for port, _ in ports]
        eval_ = [f"grpc://127.0.0.1:{ports[0][1]}"]
        self.env = nodes.env(train, eval_)
        # The nodes get the list the ranks get too: each then answers a Kubeflow client for the whole table.
        env = {**os.environ, **spec.env, **spec.secrets, **self.env}
        for i, (port, eval_port) in enumerate(ports):
            with open(self.logs[i], "ab") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, *nodes.argv(spec.config_path, i, "127.0.0.1", port, eval_port)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                        preexec_fn=process_tree.die_with_parent,
                    )
                )
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
                    raise LauncherError(
                        f"cache node {i} exited with code {code} before serving ({self.logs[i]}): {tail}"
                    )
                ready = subprocess.run(
                    [sys.executable, "-m", "datacache", "ready", endpoint], env=env, capture_output=True, timeout=60
                )
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
    """A job that ran to completion inside `launch`: by the time the caller has the handle, it is done,
    and it keeps the summary its callable returned."""

    def __init__(self, spec: LaunchSpec, state: JobState, summary: dict[str, Any] | None, started: float):
        self.name, self.run_dir = job_name(spec), spec.run_dir
        self._state, self._summary, self._started, self._ended = state, summary, started, time.time()

    def status(self) -> JobState:
        return self._state

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        return rank_logs(self.run_dir, rank, False, lambda: True)

    def step_logs(self, step: str, follow: bool = False) -> Iterator[str]:
        check_step(step, ["node-0"], self.name)
        return self.logs()

    def wait(self, timeout: float | None = None) -> JobState:
        return self._state

    def cancel(self) -> None:
        """Nothing to cancel: the run finished inside `launch`."""

    def result(self) -> dict[str, Any] | None:
        return self._summary

    def info(self) -> JobInfo:
        return JobInfo(
            self.name,
            "local",
            self._state,
            self.run_dir,
            **read_progress(self.run_dir),
            start_time=_utc(self._started),
            end_time=_utc(self._ended),
            steps=[Step("node-0", self._state)],
        )


def _register(spec: LaunchSpec, command: list[str]) -> registry.JobRecord:
    """Put the job of `spec` on record, replacing an earlier attempt of the same run that has ended."""
    name = job_name(spec)
    earlier = registry.load(name)
    if earlier is not None and LocalJob(earlier).status() == JobState.RUNNING:
        raise LauncherError(
            f"an earlier attempt of this run ({name}, pid {earlier.pid}) is still running: "
            f"python -m launchers delete {name}"
        )
    record = registry.JobRecord(name=name, run_dir=spec.run_dir, command=command, steps=step_ranks(spec))
    record.save()
    return record


class InProcessLauncher(Launcher):
    """Runs a job by calling `target` in this process (its data cache nodes, if any, beside it)."""

    name = "local"

    def __init__(self, target: Callable[[], dict[str, Any]]):
        self.target = target

    def render(self, spec: LaunchSpec) -> str:
        return f"in this process: {shlex.join([sys.executable, *spec.command])}\n"

    def launch(self, spec: LaunchSpec) -> Job:
        """Run the job to its end; on record meanwhile (as this process), so that others list and follow it."""
        record = _register(spec, [sys.executable, *spec.command])
        record.pid, record.pid_start, record.own_group = os.getpid(), registry.process_start(os.getpid()), False
        record.save()
        nodes = None
        try:
            nodes = CacheNodeProcesses(spec) if spec.cache_nodes else None
            os.environ.update({**spec.env, **spec.secrets, **(nodes.env if nodes else {})})  # the config reads them
            summary = self.target()
            record.exit_code = 0
        except BaseException:
            record.exit_code = 1
            raise
        finally:
            if nodes:
                nodes.stop()
            record.ended = time.time()
            record.save()
        return InProcessJob(spec, JobState.COMPLETE, summary, record.created)

    def jobs(self) -> list[Job]:
        return LocalLauncher({}).jobs()

    def job(self, name: str) -> Job:
        return LocalLauncher({}).job(name)


class LocalJob(Job):
    """A job on record in the registry; `proc` is its supervisor when this process started it."""

    def __init__(
        self, record: registry.JobRecord, proc: subprocess.Popen | None = None, nodes: CacheNodeProcesses | None = None
    ):
        self.name, self.run_dir, self._record = record.name, record.run_dir, record
        self._proc, self._nodes = proc, nodes

    def _current(self) -> registry.JobRecord:
        record = registry.load(self.name)
        if record is not None and record.created == self._record.created:
            self._record = record
        return self._record

    @property
    def exit_code(self) -> int | None:
        """The command's exit code, once it has ended (torchrun's is 1 for any failed rank)."""
        return self._current().exit_code

    def status(self) -> JobState:
        if self._proc is not None and self._proc.poll() is None:
            return JobState.RUNNING
        r = self._current()
        if r.cancelled:
            state = JobState.CANCELLED
        elif r.exit_code is not None:
            state = JobState.COMPLETE if r.exit_code == 0 else JobState.FAILED
        elif r.alive():
            return JobState.RUNNING
        else:  # its supervisor was killed outright: the run's summary says whether it got to the end
            state = JobState.COMPLETE if read_summary(self.run_dir) is not None else JobState.FAILED
        if self._nodes:  # the run has ended: its cache nodes go with it
            self._nodes.stop()
        return state

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        return rank_logs(self.run_dir, rank, follow, lambda: self.status().finished, self._record.console)

    def step_logs(self, step: str, follow: bool = False) -> Iterator[str]:
        """Step `step`'s lines: the job's console where the step's log is the whole job's (an MPI launcher, a
        one-node job), else its ranks' logs, one after the other."""
        steps = self._record.steps
        ranks = steps[list(steps)[check_step(step, list(steps), self.name)]]

        def finished() -> bool:
            return self.status().finished

        if ranks is None:
            return _read_log(self._record.console, follow, finished)
        return (line for rank in ranks for line in rank_logs(self.run_dir, rank, follow, finished))

    def wait(self, timeout: float | None = None) -> JobState:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                state = self.status()
                if state.finished or (deadline is not None and time.monotonic() >= deadline):
                    return state
                time.sleep(POLL_S)
        except (KeyboardInterrupt, process_tree.Terminated):
            if self._proc is not None:  # the job of this process goes with it
                self.cancel()
            raise

    def cancel(self) -> None:
        """Stop the job (its supervisor, torchrun and every rank: they share one session)."""
        r = self._current()
        if r.exit_code is None and r.alive():
            r.cancelled = True
            r.save()
            kill = os.killpg if r.own_group else os.kill  # an in-process job: its driver alone
            kill(r.pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (registry.group_alive(r.pid) if r.own_group else r.alive()) and time.monotonic() < deadline:
                if self._proc is not None:
                    self._proc.poll()  # reap it, when it is ours
                time.sleep(POLL_S)
            if registry.group_alive(r.pid) if r.own_group else r.alive():
                kill(r.pid, signal.SIGKILL)
        if self._proc is not None:
            self._proc.wait()
        if self._nodes:
            self._nodes.stop()

    def delete(self) -> None:
        self.cancel()
        current = registry.load(self.name)
        if current is not None and current.created == self._record.created:  # not a later attempt's
            registry.remove(self.name)

    def info(self) -> JobInfo:
        state = self.status()
        r = self._current()
        ended = r.ended if r.ended is not None or not state.finished else os.path.getmtime(r.path)
        return JobInfo(
            self.name,
            "local",
            state,
            self.run_dir,
            **read_progress(self.run_dir),
            start_time=_utc(r.created),
            end_time=_utc(ended),
            steps=[Step(step, state) for step in r.steps],
        )


class DamagedJob(Job):
    """A job whose record cannot be read: every question about it is that one-line error, and `delete`
    removes the record (and its console log)."""

    def __init__(self, name: str, error: registry.DamagedRecord):
        self.name, self.error = name, error

    def status(self) -> JobState:
        raise self.error

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        raise self.error

    def step_logs(self, step: str, follow: bool = False) -> Iterator[str]:
        raise self.error

    def wait(self, timeout: float | None = None) -> JobState:
        raise self.error

    def cancel(self) -> None:
        """Nothing to stop that the record could say."""

    def info(self) -> JobInfo:
        raise self.error

    def delete(self) -> None:
        registry.remove(self.name)


class LocalLauncher(Backend):
    name = "local"

    def __init__(self, options: Mapping[str, Any]):
        self.options = dict(options)
        self.wait = bool(options.get("wait", True))

    def function_job_rules(self, unit: Runtime, job: Any) -> None:
        """A function job's nodes are processes here: one node under torchrun, and what the runtime needs here."""
        if job.runtime == "torch-distributed" and job.num_nodes != 1:
            raise ValueError(f"num_nodes={job.num_nodes}: launcher=local runs one node under "
                             "torch-distributed (use nproc_per_node)")
        lacking = unit.missing()
        if lacking:
            raise ValueError(lacking)

    def runtime_image(self, unit: Runtime) -> str:
        return "local"

    def device(self) -> tuple[str, str]:
        gpus = local_gpus()
        return ("gpu", str(gpus)) if gpus else ("cpu", str(os.cpu_count() or 1))

    def get_runtime_packages(self, name: str) -> str:
        """This machine's environment, which local jobs of runtime `name` run in: Python, `pip list`, `nvidia-smi`,
        and what the runtime lacks here (with the pip extra that installs it)."""
        lacking = runtime_unit(name).missing()
        lines = [f"Python: {sys.version}"]
        pip = subprocess.run([sys.executable, "-m", "pip", "list", "--disable-pip-version-check"],
                             capture_output=True, text=True)
        lines.append(pip.stdout.rstrip() if pip.returncode == 0 else f"Unable to get installed packages: {pip.stderr}")
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True)
            lines += ["Available GPUs on the single training node", smi.stdout.rstrip()]
        if lacking:
            lines.append(f"missing: {lacking}")
        return "\n".join(lines) + "\n"

    def command(self, spec: LaunchSpec) -> list[str]:
        if spec.runtime is None:
            return [sys.executable, *spec.command]
        if spec.packages:  # the ranks run the job's own environment, made and filled first
            venv = RunDir.of(spec.run_dir).venv
            return packages.command(sys.executable, venv, spec.packages, node_command(spec, packages.venv_python(venv)))
        return node_command(spec, sys.executable)

    def render(self, spec: LaunchSpec) -> str:
        return shlex.join(self.command(spec)) + "\n"

    def launch(self, spec: LaunchSpec) -> Job:
        if spec.cache_nodes and not self.wait:
            raise LauncherError(
                "data.cache.nodes start beside the ranks and stop with this process: use "
                "launcher.wait=true with launcher=local"
            )
        record = _register(spec, self.command(spec))
        name, nodes = record.name, None
        try:
            nodes = CacheNodeProcesses(spec) if spec.cache_nodes else None
            if store_apart(spec):
                start_rendezvous_store(spec)
            env = {
                **os.environ,
                **(spec.runtime.unit.agent_env(spec.runtime.options) if spec.runtime else {}),
                **spec.env,
                **spec.secrets,
                **(nodes.env if nodes else {}),
            }
            # A session of its own, so that a cancel stops the supervisor, torchrun and every rank it started.
            proc = subprocess.Popen(
                [sys.executable, "-m", "launchers.supervise", name],
                env=env,
                start_new_session=True,
                preexec_fn=process_tree.die_with_parent if self.wait else None,
                stdin=subprocess.DEVNULL,
                pass_fds=spec.hold_fds,
                **({} if self.wait else {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}),
            )
            if not self.wait:  # it runs on after this process
                process_tree.detach(proc.pid)
            deadline = time.monotonic() + 30
            while (registry.load(name) or record).pid is None:  # the supervisor puts itself on record first
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise LauncherError(f"the local job's supervisor exited with code {proc.poll()} before it started")
                time.sleep(0.02)
        except BaseException:
            if nodes:
                nodes.stop()
            registry.remove(name)  # nothing started: nothing on record
            raise
        return LocalJob(registry.load(name) or record, proc if self.wait else None, nodes)

    def jobs(self) -> list[Job]:
        return [LocalJob(r) for r in registry.all_records()]

    def job(self, name: str) -> Job:
        try:
            record = registry.read(name)
        except registry.DamagedRecord as e:
            return DamagedJob(name, e)
        if record is None:
            raise LauncherError(
                f"no local job {name!r} (the jobs on record are in {registry.jobs_dir()}: python -m launchers list)"
            )
        return LocalJob(record)


def make(options: Mapping[str, Any], scheduler: Mapping[str, Any] | None = None) -> LocalLauncher:
    return LocalLauncher(options)
