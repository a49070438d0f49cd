"""The local job registry: one JSON file per job under `$TRAINJOB_HOME/jobs/` (default
`~/.local/state/trainjob/jobs/`), so that a job started by one process is listed, followed, waited for
and deleted from any other. A record holds the job's supervisor pid, run directory, command, start and
end times, and its exit code once `launchers.supervise` wrote it (`<name>.log` beside it holds what the
job printed); a supervisor that died without writing one (killed outright) leaves a pid that is gone, and
the job counts as ended then.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field

HOME_ENV = "TRAINJOB_HOME"


def jobs_dir() -> str:
    home = os.environ.get(HOME_ENV) or os.path.join(os.path.expanduser("~"), ".local", "state", "trainjob")
    return os.path.join(home, "jobs")


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

    @property
    def path(self) -> str:
        return os.path.join(jobs_dir(), f"{self.name}.json")

    @property
    def console(self) -> str:
        """What the job's processes printed (its supervisor copies it here; the run directory holds only
        what the job itself writes)."""
        return os.path.join(jobs_dir(), f"{self.name}.log")

    def save(self) -> None:
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


def load(name: str) -> JobRecord | None:
    try:
        with open(os.path.join(jobs_dir(), f"{name}.json")) as f:
            return JobRecord(**json.load(f))
    except FileNotFoundError:
        return None


def all_records() -> list[JobRecord]:
    """Every job on record, oldest first."""
    if not os.path.isdir(jobs_dir()):
        return []
    records = [load(f[:-5]) for f in os.listdir(jobs_dir()) if f.endswith(".json")]
    return sorted((r for r in records if r is not None), key=lambda r: r.created)


def remove(name: str) -> None:
    """Forget job `name`: its record and its console log."""
    for suffix in (".json", ".log"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(jobs_dir(), f"{name}{suffix}"))
