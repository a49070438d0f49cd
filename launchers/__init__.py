"""Launchers decide where the ranks of a run start; every one runs the same worker command line.

`launchers.get(name)` returns the launcher for `cfg.launcher.name`. Nothing here imports torch at module
top: submitting a job must not need a GPU stack.
"""

from __future__ import annotations

import importlib

from launchers.base import Job, JobState, Launcher, Run

__all__ = ["Job", "JobState", "Launcher", "Run", "get"]

_MODULES = {"local": "launchers.local"}


def get(name: str) -> Launcher:
    if name not in _MODULES:
        raise KeyError(f"launcher {name!r} is not one of {', '.join(sorted(_MODULES))}")
    return importlib.import_module(_MODULES[name]).LAUNCHER
