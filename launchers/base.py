"""The launcher interface (`render(spec)`, `launch(spec) -> Job`, `jobs()`, `job(name)`; the Client's verbs on it
are `launchers.backend.Backend`'s), the launch spec every launcher receives, and `node_command`: the one way a
launcher asks the spec's runtime how a node's ranks start (the runtime builds it: `trainjob.runtimes`).
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from trainjob import runtimes
from trainjob.env import CACHE_ENDPOINTS_ENV, CACHE_EVAL_ENDPOINTS_ENV
from trainjob.files import write_whole
from trainjob.options import OptionError as OptionError
from trainjob.options import require as require
from trainjob.run_files import read_metrics, read_summary
from trainjob.runtimes import UNKNOWN, Nodes


class LauncherError(RuntimeError):
    """A launcher could not do what was asked; the message says what and why."""


class JobState(str, enum.Enum):
    """Kubeflow Trainer's TrainJob states, and Cancelled for a job this client stopped."""

    CREATED = "Created"
    RUNNING = "Running"
    COMPLETE = "Complete"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.COMPLETE, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class CacheNodes:
    """Data cache nodes to start beside the ranks (`data.cache.nodes`). Node i runs the interpreter with
    `command`, whose `{config}`, `{index}`, `{count}`, `{host}`, `{port}` and `{eval_port}` the launcher
    fills in; it serves its share of the training rows on `port` (and node 0 the eval rows on
    `eval_port`) once `python -m datacache ready` answers there. The ranks find them through
    `trainjob.env`'s CACHE_ENDPOINTS_ENV and CACHE_EVAL_ENDPOINTS_ENV."""

    count: int
    command: list[str]
    port: int = 50051
    eval_port: int = 50052
    # Kubeflow Trainer's cache in their place (`data.cache.backend=kubeflow`, Kubernetes only): its dataset
    # initializer's settings (the data.cache.kubeflow section); `count` data nodes, no `command` run.
    kubeflow: dict[str, str] | None = None

    def argv(self, config: str, index: int, host: str, port: int, eval_port: int) -> list[str]:
        values = {
            "config": config,
            "index": index,
            "count": self.count,
            "host": host,
            "port": port,
            "eval_port": eval_port,
        }
        return [part.format(**values) for part in self.command]

    def env(self, train: list[str], eval_: list[str]) -> dict[str, str]:
        """The ranks' environment naming the nodes (lists in OmegaConf's syntax, for oc.decode)."""
        return {CACHE_ENDPOINTS_ENV: "[" + ",".join(train) + "]", CACHE_EVAL_ENDPOINTS_ENV: "[" + ",".join(eval_) + "]"}


@dataclass(frozen=True)
class RuntimeSpec:
    """The runtime that starts the ranks (`unit`: its `trainjob.runtimes.Runtime`, looked up once by whoever
    made the spec) and its options (the run's `runtime` section, as a mapping); `of` looks it up by name and
    fills in its defaults."""

    unit: runtimes.Runtime
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str = "torch-distributed", options: dict[str, Any] | None = None) -> RuntimeSpec:
        unit = runtimes.get(name)
        return cls(unit, {**asdict(unit.schema()), **(options or {})})

    @property
    def name(self) -> str:
        return self.unit.name


@dataclass(frozen=True)
class LaunchSpec:
    """What to start, and nothing of what it trains: run `command` (the interpreter's arguments, such as
    `-m trainer.worker <run_dir>/config.yaml`) on `nnodes` nodes, `nproc_per_node` processes each under
    `runtime` (None: one process, no runtime), with `env` and `secrets` (environment variables that are never
    written or printed) in its environment. `worker`: the module `command` runs where it is the trainer's worker
    (`trainer.__main__` names it), so that the runtime starts it under the agent that passes a rank's exit code on;
    None: a user's script (a function job).

    `config` is the document the command reads, saved at `config_path` in `run_dir`; launchers never look
    inside it, except that one whose nodes do not share this machine's disk (Kubernetes) ships it and
    moves the paths that `path_keys` names (`run_dir`, `cache_dir`: dotted keys of the document) onto its
    own volumes. `files` are other files of `run_dir` the command reads (name -> text), shipped the same
    way. `cache_dir` is this machine's data cache, which the job reads and writes (Docker mounts it).
    `hold_fds` are descriptors the job's processes on this machine keep open while it runs (the run
    directory's locks, so that they are held as long as the job runs, also after the driver has returned).

    `min_nodes` (None: a fixed size) makes the job elastic: torchrun runs between `min_nodes` and `nnodes`
    nodes and re-forms the group when one is lost or joins. `node` is which of the run's nodes this machine
    starts, when each node is launched on its own (the local launcher, once per node)."""

    run_dir: str
    command: list[str]
    nnodes: int = 1
    nproc_per_node: int = 1
    runtime: RuntimeSpec | None = None
    env: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    config_path: str | None = None
    path_keys: dict[str, str] = field(default_factory=dict)
    cache_dir: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    cache_nodes: CacheNodes | None = None
    # Seconds the ranks get between SIGTERM and SIGKILL to write a checkpoint (None: the platform's default).
    stop_grace_s: int | None = None
    hold_fds: tuple[int, ...] = ()
    min_nodes: int | None = None
    node: int | None = None
    # pip requirements installed where the ranks run before they start (a function job's packages_to_install):
    # locally into a virtual environment of the job's own (`launchers.packages`), on Kubernetes once per node.
    packages: tuple[str, ...] = ()
    worker: str | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None


MASK = "********"


def write_private(path: str, text: str) -> None:
    """Write `path` readable by its owner only (0600), replacing it whole."""
    write_whole(path, text, 0o600)


def store_apart(spec: LaunchSpec) -> bool:
    """Whether the job's rendezvous store is hosted apart from its nodes: elastic, or nodes started one by one."""
    return spec.elastic or spec.node is not None


def node_command(spec: LaunchSpec, python: str, endpoint: str | None = None, hosts: tuple[str, ...] = (),
                 env_names: tuple[str, ...] = (), node: int | None = None) -> list[str]:
    """The command that starts one node's ranks of `spec` (or, under a runtime that reaches every node from one
    launcher, all of them), as its runtime builds it: `python` runs the ranks, `endpoint` is where they meet,
    `hosts` are the nodes a launcher reaches, `env_names` the variables it passes on; `node`: the node it starts,
    where each runs on a host of its own."""
    nodes = Nodes(command=list(spec.command), python=python, nnodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
                  min_nodes=spec.min_nodes, endpoint=endpoint, store_apart=store_apart(spec), hosts=hosts,
                  env_names=env_names, node=node, worker=spec.worker)
    return spec.runtime.unit.node_command(spec.runtime.options, nodes)


def run_name(run_dir: str, max_len: int = 52) -> str:
    """A name for the job of the run in `run_dir`: an RFC 1035 label (lower-case letters, digits and '-',
    starting with a letter) of at most `max_len` characters, from the directory's name plus a hash of its
    path, so unique per run and the same whenever this run is rendered."""
    base = re.sub(r"[^a-z0-9]+", "-", os.path.basename(run_dir).lower()).strip("-")
    suffix = hashlib.sha256(run_dir.encode()).hexdigest()[:8]
    return f"tj-{base}"[: max_len - len(suffix) - 1].rstrip("-") + "-" + suffix


@dataclass(frozen=True)
class Step:
    """One node of a job as Kubeflow's SDK lists it (`TrainJob.steps`, `get_job_logs(step=...)`): `node-<i>` for
    node i; under an MPI runtime (mpirun starts every rank from one launcher) `node-0` is the launcher, whose log
    holds every rank's output, and node host i is `node-<i+1>`. `pod_name`: the container or pod it runs in
    (None locally: processes here)."""

    name: str
    status: JobState
    pod_name: str | None = None
    device: str = UNKNOWN
    device_count: str = UNKNOWN


def step_ranks(spec: LaunchSpec) -> dict[str, list[int] | None]:
    """The steps of the job `spec` starts, with the ranks each runs (in rank order); None for a step whose log is
    the job's whole output: an MPI job's launcher (mpirun prints every rank's), a one-node job's node. Under MPI
    the hosts mpirun fills are the launcher first where it is a host (runLauncherAsNode), then the node hosts."""
    per_node = spec.nproc_per_node

    def ranks(host: int) -> list[int]:
        return list(range(host * per_node, (host + 1) * per_node)) if host < spec.nnodes else []

    if spec.node is not None:  # one node of a run started node by node
        return {f"node-{spec.node}": ranks(spec.node)}
    unit = spec.runtime.unit if spec.runtime else None
    if unit is None or not unit.hosts_over_ssh:
        return {"node-0": None} if spec.nnodes == 1 else {f"node-{i}": ranks(i) for i in range(spec.nnodes)}
    as_node = bool(spec.runtime.options.get("run_launcher_as_node", True))
    hosts = unit.ssh_hosts().node_hosts(spec.nnodes, as_node)
    return {"node-0": None, **{f"node-{i + 1}": ranks(i + as_node) for i in range(hosts)}}


def check_step(step: str, steps: list[str], job: str) -> int:
    """The index of `step` among the job's `steps`; LauncherError listing them where it is none of them."""
    if step not in steps:
        raise LauncherError(f"step={step!r}: job {job} has steps {', '.join(steps)}")
    return steps.index(step)


@dataclass
class JobInfo:
    """What `Client.get_job` says of a job: its state, its progress (the last logged step and loss, the
    last eval loss) and when it started and ended (UTC)."""

    name: str
    launcher: str
    state: JobState
    run_dir: str | None = None
    step: int | None = None
    loss: float | None = None
    eval_loss: float | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    # The run's events (`read_events`), oldest first: {"event": "resume" | "reformation" | "preemption",
    # "time", ...}; a re-formation's "world_size_before", "world_size_after", "resumed_from_step".
    events: list[dict[str, Any]] = field(default_factory=list)
    # Its nodes, as Kubeflow's SDK names them (`Step`).
    steps: list[Step] = field(default_factory=list)


class Job(ABC):
    """A launched run. `logs` yields lines of one rank's (or node's) log."""

    name: str
    run_dir: str | None = None
    # What ended a failed job, on one line naming the node (container, pod) that failed first, where the
    # launcher can tell.
    failure: str | None = None

    @abstractmethod
    def status(self) -> JobState: ...

    @abstractmethod
    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]: ...

    @abstractmethod
    def step_logs(self, step: str, follow: bool = False) -> Iterator[str]:
        """Lines of step `step`'s log (`Step`): an MPI job's `node-0` holds every rank's output."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> JobState: ...

    @abstractmethod
    def cancel(self) -> None: ...

    @abstractmethod
    def info(self) -> JobInfo: ...

    def delete(self) -> None:
        """Stop the job and remove it from the launcher's list (its run directory stays)."""
        self.cancel()

    def result(self) -> dict[str, Any] | None:
        """The run's summary.json, once it exists where this machine can read it."""
        return read_summary(self.run_dir) if self.run_dir else None

    def metrics(self) -> list[dict[str, Any]]:
        """The run's metrics records, oldest first (its metrics.jsonl: one a logged step, eval_loss where it
        evaluated), read from its run directory."""
        if not self.run_dir:
            raise LauncherError(
                f"job {self.name}: its metrics are in its run directory, which this machine does not see (on "
                "Kubernetes: local_run_root=, where the pods' run directories are mounted here)"
            )
        return read_metrics(self.run_dir)


class PollingJob(Job):
    """A job whose `wait` polls `status()` every `poll_seconds` until it finishes or `timeout` passes."""

    poll_seconds: float = 2.0

    def wait(self, timeout: float | None = None) -> JobState:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.status()
            if state.finished or (deadline is not None and time.monotonic() >= deadline):
                return state
            time.sleep(self.poll_seconds)


class Launcher(ABC):
    """A place where jobs run. `render` says what `launch` would start (a dry run prints it); `launch`
    starts it and returns its Job; `jobs` and `job` find the jobs there, also those another process
    started."""

    name: str

    @abstractmethod
    def render(self, spec: LaunchSpec) -> str: ...

    @abstractmethod
    def launch(self, spec: LaunchSpec) -> Job: ...

    @abstractmethod
    def jobs(self) -> list[Job]: ...

    @abstractmethod
    def job(self, name: str) -> Job:
        """The job called `name`; LauncherError when there is none."""
