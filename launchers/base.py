"""The launcher interface (`launch(run) -> Job`, `list_jobs()`) and the one place that builds the worker
command line and the torchrun options that every launcher uses.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

WORKER_MODULE = "trainer.worker"

# Environment for every torchrun that a launcher starts. Sharing torchrun's rendezvous store with the
# workers (the default) lets restarted workers read the failed attempt's addresses, so a restart after
# a dead rank fails to connect (pytorch/pytorch#135712); a fresh store per attempt avoids it.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class LauncherError(RuntimeError):
    """A launcher could not do what was asked; the message says what and why."""


class JobState(str, enum.Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class CacheNodes:
    """Data cache nodes to start beside the ranks (`data.cache.nodes`). Node i runs the interpreter with
    `command`, whose `{config}`, `{index}`, `{count}`, `{host}`, `{port}` and `{eval_port}` the launcher
    fills in; it serves its share of the training rows on `port` (and node 0 the eval rows on
    `eval_port`) once `python -m datacache ready` answers there. The ranks find them through ENDPOINTS_ENV
    and EVAL_ENDPOINTS_ENV, lists the run's config reads with `${oc.decode:${oc.env:...}}`."""

    count: int
    command: list[str]
    port: int = 50051
    eval_port: int = 50052

    ENDPOINTS_ENV = "TRAINJOB_CACHE_ENDPOINTS"
    EVAL_ENDPOINTS_ENV = "TRAINJOB_CACHE_EVAL_ENDPOINTS"

    def argv(self, config: str, index: int, host: str, port: int, eval_port: int) -> list[str]:
        values = {"config": config, "index": index, "count": self.count, "host": host, "port": port,
                  "eval_port": eval_port}
        return [part.format(**values) for part in self.command]

    def env(self, train: list[str], eval_: list[str]) -> dict[str, str]:
        """The ranks' environment naming the nodes (lists in OmegaConf's syntax, for oc.decode)."""
        return {self.ENDPOINTS_ENV: "[" + ",".join(train) + "]", self.EVAL_ENDPOINTS_ENV: "[" + ",".join(eval_) + "]"}


@dataclass(frozen=True)
class Run:
    """One resolved run: its config (a plain dict, as saved: never a secret), where it lives, its world
    size, and `secrets`: environment variables the ranks need that are never written or printed (the
    config refers to them as `${oc.env:NAME}`). Each launcher hands them to the ranks its own way."""

    config: dict[str, Any]
    run_dir: str
    config_path: str
    world_size: int
    secrets: dict[str, str] = field(default_factory=dict)
    cache_nodes: CacheNodes | None = None


MASK = "********"


def write_private(path: str, text: str) -> None:
    """Write `path` readable by its owner only (0600), replacing it whole."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def worker_command(config_path: str) -> list[str]:
    """The rank entry point's arguments after the interpreter or torchrun: `-m trainer.worker <file>`."""
    return ["-m", WORKER_MODULE, config_path]


def torchrun_args(runtime: dict[str, Any], nproc_per_node: int, endpoint: str | None = None) -> list[str]:
    """torchrun's options for a `runtime` config. One node without an endpoint uses --standalone; else a
    c10d rendezvous at `endpoint` (default: the runtime's rdzv_endpoint), which every node joins."""
    args = [f"--nproc-per-node={nproc_per_node}", f"--nnodes={runtime['nnodes']}",
            f"--max-restarts={runtime['max_restarts']}", f"--monitor-interval={runtime['monitor_interval']}"]
    endpoint = endpoint or runtime.get("rdzv_endpoint")
    if runtime["nnodes"] == 1 and not endpoint:
        return [*args, "--standalone"]
    return [*args, f"--rdzv-backend={runtime['rdzv_backend']}", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={runtime['rdzv_id']}"]


def run_name(run_dir: str, max_len: int = 52) -> str:
    """A name for the job of the run in `run_dir`: an RFC 1035 label (lower-case letters, digits and '-',
    starting with a letter) of at most `max_len` characters, from the directory's name plus a hash of its
    path, so unique per run and the same whenever this run is rendered."""
    base = re.sub(r"[^a-z0-9]+", "-", os.path.basename(run_dir).lower()).strip("-")
    suffix = hashlib.sha256(run_dir.encode()).hexdigest()[:8]
    return f"tj-{base}"[:max_len - len(suffix) - 1].rstrip("-") + "-" + suffix


def read_summary(run_dir: str) -> dict[str, Any] | None:
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


class Job(ABC):
    """A launched run. `logs` yields lines of one rank's (or node's) log."""

    name: str
    run: Run

    @abstractmethod
    def status(self) -> JobState: ...

    @abstractmethod
    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]: ...

    @abstractmethod
    def wait(self, timeout: float | None = None) -> JobState: ...

    @abstractmethod
    def cancel(self) -> None: ...

    def result(self) -> dict[str, Any] | None:
        """The run's summary.json, once it exists."""
        return read_summary(self.run.run_dir)


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
    @abstractmethod
    def launch(self, run: Run) -> Job: ...

    @abstractmethod
    def list_jobs(self) -> list[Job]: ...
