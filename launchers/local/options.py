"""The local launcher's options (`launcher=local`): their schema and their checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launchers import registry
from launchers.base import OptionError
from trainjob.runtimes import Offers


@dataclass
class LocalLauncherConfig:
    name: str = "local"  # the option chosen
    # true: wait for the run and end it with this process; false: start it, print its name and return
    # (it runs on; `python -m launchers list|get|logs|wait|delete` find it).
    wait: bool = True
    dry_run: bool = False  # print the command (or that it runs in this process) and start nothing


def offers(options: Mapping[str, Any]) -> Offers:
    """This machine: its GPUs, its disk, its packages; a job without a runtime in the driver's own process (when
    the driver waits for it); a multi-node run started once per node."""
    return Offers(runs_here=True, gpus_per_node=None, reads_disk_here=True,
                  in_process=bool(options.get("wait", True)), nodes_started_here=True, cpus_here=True)


def check(options: Mapping[str, Any], nnodes: int | None, paths: Mapping[str, str]) -> None:
    """The job registry must be writable (the job goes on record there); the rest about this machine is
    what the data says (the trainer checks that)."""
    problem = registry.home_problem()
    if problem:
        key, _, rest = problem.partition(": ")
        name, _, value = key.partition("=")
        raise OptionError(name if value else "TRAINJOB_HOME", value or registry.home(), rest)
