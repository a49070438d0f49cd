"""Launchers decide where the ranks of a run start; every one runs the command of a `LaunchSpec`.

`launchers.get(options, scheduler)` (`launchers.options`) returns the launcher that a `launcher` option node
describes; each launcher module holds its options' schema (`LAUNCHER_SCHEMAS`) and rules (`check`). `Client` drives jobs
on any launcher from Python, and `python -m launchers` from a terminal. Nothing here imports torch or the
trainer: submitting a job must not need a GPU stack.

Its names load on first use (as `datacache`'s do), so that importing one launcher module (a rank reading
`launchers.base`) loads no other backend: the Kubernetes manifests and the Docker client stay unimported until
a launcher of theirs is asked for.
"""

from __future__ import annotations

import importlib

_HOMES = {
    **dict.fromkeys(("CacheNodes", "Job", "JobInfo", "JobState", "Launcher", "LauncherError", "LaunchSpec",
                     "OptionError", "Torchrun", "node_range"), "launchers.base"),
    "Client": "launchers.client",
    "InProcessLauncher": "launchers.local",
    **dict.fromkeys(("LAUNCHER_SCHEMAS", "check", "get"), "launchers.options"),
    "SchedulerConfig": "launchers.schedulers",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'launchers' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
