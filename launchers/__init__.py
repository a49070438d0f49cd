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

from trainjob import lazy

_HOMES = {
    **dict.fromkeys(("CacheNodes", "Job", "JobInfo", "JobState", "Launcher", "LauncherError", "LaunchSpec",
                     "OptionError", "RuntimeSpec"), "launchers.base"),
    "Client": "launchers.client",
    "InProcessLauncher": "launchers.local.backend",
    **dict.fromkeys(("LAUNCHER_SCHEMAS", "check", "get", "offers"), "launchers.options"),
    "SchedulerConfig": "launchers.kubernetes.schedulers",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy.names(__name__, _HOMES)
