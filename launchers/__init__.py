"""Launchers decide where the ranks of a run start; every one runs the same worker command line.

`launchers.get(cfg.launcher)` returns the launcher that config describes. Nothing here imports torch at
module top: submitting a job must not need a GPU stack.
"""

from __future__ import annotations

import importlib
from typing import Any

from launchers.base import CacheNodes, Job, JobState, Launcher, LauncherError, Run

__all__ = ["CacheNodes", "Job", "JobState", "Launcher", "LauncherError", "Run", "get"]

_MODULES = {"local": "launchers.local", "docker": "launchers.docker", "kubernetes": "launchers.kubernetes"}


def get(config: dict[str, Any]) -> Launcher:
    """The launcher for a `launcher` config node (a dict with at least `name`)."""
    name = config["name"]
    if name not in _MODULES:
        raise KeyError(f"launcher {name!r} is not one of {', '.join(sorted(_MODULES))}")
    return importlib.import_module(_MODULES[name]).make(dict(config))
