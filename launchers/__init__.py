"""Launchers decide where the ranks of a run start; every one runs the command of a `LaunchSpec`.

`launchers.get(options, scheduler)` (`launchers.options`) returns the launcher that a `launcher` option node
describes; each launcher module holds its options' schema (`LAUNCHER_SCHEMAS`) and rules (`check`). `Client` drives jobs
on any launcher from Python, and `python -m launchers` from a terminal. Nothing here imports torch or the
trainer: submitting a job must not need a GPU stack.
"""

from __future__ import annotations

from launchers.base import (
    CacheNodes,
    Job,
    JobInfo,
    JobState,
    Launcher,
    LauncherError,
    LaunchSpec,
    OptionError,
    Torchrun,
    node_range,
)
from launchers.client import Client
from launchers.local import InProcessLauncher
from launchers.options import LAUNCHER_SCHEMAS, check, get
from launchers.schedulers import SchedulerConfig

__all__ = [
    "LAUNCHER_SCHEMAS",
    "CacheNodes",
    "Client",
    "InProcessLauncher",
    "Job",
    "JobInfo",
    "JobState",
    "LaunchSpec",
    "Launcher",
    "LauncherError",
    "OptionError",
    "SchedulerConfig",
    "Torchrun",
    "check",
    "get",
    "node_range",
]
