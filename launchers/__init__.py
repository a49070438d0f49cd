"""Launchers decide where the ranks of a run start; every one runs the command of a `LaunchSpec`.

`launchers.get(options, scheduler)` returns the launcher that a `launcher` option node describes; each
launcher module holds its options' schema (`LAUNCHER_SCHEMAS`) and rules (`check`). `Client` drives jobs
on any launcher from Python, and `python -m launchers` from a terminal. Nothing here imports torch or the
trainer: submitting a job must not need a GPU stack.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

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
from launchers.docker import DockerLauncherConfig
from launchers.kubernetes import KubernetesLauncherConfig
from launchers.local import InProcessLauncher, LocalLauncherConfig
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

_MODULES = {"local": "launchers.local", "docker": "launchers.docker", "kubernetes": "launchers.kubernetes"}

LAUNCHER_SCHEMAS = {
    "local": LocalLauncherConfig,
    "docker": DockerLauncherConfig,
    "kubernetes": KubernetesLauncherConfig,
}


def _module(name: str):
    if name not in _MODULES:
        raise OptionError("launcher.name", name, f"must be one of {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[name])


def check(
    options: Mapping[str, Any], scheduler: Mapping[str, Any], nnodes: int | None, paths: Mapping[str, str]
) -> None:
    """The launcher's and the scheduler's rules for a job of `nnodes` nodes under torchrun (None: one
    process, no torchrun) whose config keys `paths` hold host paths; raises OptionError."""
    from launchers import schedulers

    _module(options["name"]).check(options, nnodes, paths)
    schedulers.check(scheduler, options["name"])


def get(options: Mapping[str, Any], scheduler: Mapping[str, Any] | None = None) -> Launcher:
    """The launcher for a `launcher` option node (a mapping with at least `name`), and on Kubernetes the
    gang `scheduler` its jobs go through."""
    return _module(options["name"]).make(dict(options), dict(scheduler) if scheduler else None)


from launchers.client import Client  # noqa: E402  (it uses get() and the schemas above)
