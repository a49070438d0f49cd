"""The local job registry: one JSON file per job under `$TRAINJOB_HOME/jobs/` (default
`~/.local/state/trainjob/jobs/`), so that a job started by one process is listed, followed, waited for
and deleted from any other. A record holds the job's supervisor pid, run directory, command, start and
end times, and its exit code once `launchers.supervise` wrote it (`<name>.log` beside it holds what the
job printed); a supervisor that died without writing one (killed outright) leaves a pid that is gone, and
the job counts as ended then. A record that cannot be read (truncated, not a record) is named in one line
by `python -m launchers list` and removed by `delete`; it never hides the other jobs. Keys a record does not
have (another version of trainjob wrote them, or a hand) are ignored with a warning naming them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

from launchers.base import LauncherError
from trainjob.files import directory_problem

HOME_ENV = "TRAINJOB_HOME"
log = logging.getLogger("launchers")


def home() -> str:
    return os.environ.get(HOME_ENV) or os.path.join(os.path.expanduser("~"), ".local", "state", "trainjob")


def jobs_dir() -> str:
    return os.path.join(home(), "jobs")


def home_problem(writing: bool = True) -> str | None:
    """What stops the registry from being used (read, or also written), naming its directory and how it is
    chosen: one line, or None."""
    problem = directory_problem(home()) or directory_problem(jobs_dir())
    if problem is None or (not writing and "not writable" in problem):
        return None
    where = f"{HOME_ENV}={home()}" if os.environ.get(HOME_ENV) else f"the job registry {jobs_dir()}"
    return f"{where}: {problem}; local jobs are on record in <{HOME_ENV}>/jobs (default ~/.local/state/trainjob)"


class DamagedRecord(LauncherError):
    """A job record that exists but cannot be read; the message names the file."""


@dataclass
class JobRecord:
    name: str
    run_dir: str
    command: list[str]
    pid: int | None = None
    pid_start: str | None = None  # the process's start time in /proc, so that a reused pid is not taken for it
    created: float = field(default_factory=time.time)
    ended: float | None = None
    exit_code: int | None = None
    cancelled: bool = False
    own_group: bool = True  # the pid leads a process group of the job's own (else: a driver running it in process)
    # Its steps (Kubeflow's node-<i>) and the ranks each runs; null: the step's log is the job's console.
    steps: dict[str, list[int] | None] = field(default_factory=lambda: {"node-0": None})

    @property
    def path(self) -> str:
        return os.path.join(jobs_dir(), f"{self.name}.json")

    @property
    def console(self) -> str:
        """What the job's processes printed (its supervisor copies it here; the run directory holds only
        what the job itself writes)."""
        return os.path.join(jobs_dir(), f"{self.name}.log")

    def save(self) -> None:
        problem = home_problem()
        if problem:
            raise LauncherError(problem)
        os.makedirs(jobs_dir(), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, self.path)

    def alive(self) -> bool:
        """Whether the supervisor still runs (a zombie, or a pid reused by another process, does not)."""
        if self.pid is None:
            return False
        stat = process_start(self.pid)
        return stat is not None and stat != "Z" and (self.pid_start is None or stat == self.pid_start)


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (in clock ticks since boot, from /proc), "Z" for a zombie, None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return "Z" if fields[0] in ("Z", "X") else fields[19]


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` (a job's supervisor, torchrun, its ranks) still runs."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
    return False


_FIELDS = {f.name: f for f in dataclasses.fields(JobRecord)}
# The JSON types each key of a record takes (bool is no number here: json gives True for true only).
_TYPES = {"name": (str,), "run_dir": (str,), "command": (list,), "pid": (int, type(None)),
          "pid_start": (str, type(None)), "created": (int, float), "ended": (int, float, type(None)),
          "exit_code": (int, type(None)), "cancelled": (bool,), "own_group": (bool,),
          "steps": (dict,)}
_warned: set[str] = set()  # the records whose unknown keys this process has warned of (once each)


def read(name: str) -> JobRecord | None:
    """Job `name`'s record, None when there is none; DamagedRecord when its file cannot be read as one."""
    path = os.path.join(jobs_dir(), f"{name}.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # truncated, empty, not UTF-8, unreadable
        raise DamagedRecord(f"job record {path} cannot be read ({e}): python -m launchers delete {name}") from None
    missing = sorted(k for k, f in _FIELDS.items() if isinstance(data, dict) and k not in data
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    wrong = sorted(k for k, types in _TYPES.items() if isinstance(data, dict) and k in data and (
        not isinstance(data[k], types) or (isinstance(data[k], bool) and bool not in types)
        or (k == "command" and not all(isinstance(a, str) for a in data[k]))
        or (k == "steps" and not all(r is None or (isinstance(r, list) and all(type(i) is int for i in r))
                                     for r in data[k].values()))))
    if not isinstance(data, dict) or missing or wrong or data.get("name") != name:
        what = (f"a JSON {type(data).__name__}, not an object" if not isinstance(data, dict)
                else f"no {missing}" if missing else f"{wrong} of the wrong type" if wrong
                else f"the record of {data.get('name')!r}")
        raise DamagedRecord(f"job record {path} is not a job record ({what}): python -m launchers delete {name}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown and path not in _warned:  # written by another version of trainjob, or edited: the rest is a record
        _warned.add(path)
        log.warning("warning: job record %s: ignoring unknown keys %s", path, unknown)
    return JobRecord(**{k: v for k, v in data.items() if k in _FIELDS})


def load(name: str) -> JobRecord | None:
    """Job `name`'s record, or None when there is none or it is damaged (an attempt that ended)."""
    try:
        return read(name)
    except DamagedRecord:
        return None


def all_records() -> list[JobRecord]:
    """Every job on record, oldest first; each damaged record is skipped with a warning that names it."""
    problem = home_problem(writing=False)
    if problem:
        raise LauncherError(problem)
    if not os.path.isdir(jobs_dir()):
        return []
    records = []
    for f in sorted(os.listdir(jobs_dir())):
        if f.endswith(".json"):
            try:
                records.append(read(f[:-5]))
            except DamagedRecord as e:
                log.warning("warning: %s", e)
    return sorted((r for r in records if r is not None), key=lambda r: r.created)


def remove(name: str) -> None:
    """Forget job `name`: its record and its console log."""
    for suffix in (".json", ".log"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(jobs_dir(), f"{name}{suffix}"))
