"""The launcher options: each launcher's schema (`LAUNCHER_SCHEMAS`), its and the gang scheduler's rules
(`check`), and the launcher an option node names (`get`). Each launcher's package holds its own schema and
rules (`options`) apart from its backend; this module only chooses among them."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from launchers.base import Launcher, OptionError
from launchers.docker.options import DockerLauncherConfig
from launchers.kubernetes import schedulers
from launchers.kubernetes.options import KubernetesLauncherConfig
from launchers.local.options import LocalLauncherConfig
from trainjob.runtimes import Offers

_NAMES = ("local", "docker", "kubernetes")

LAUNCHER_SCHEMAS = {
    "local": LocalLauncherConfig,
    "docker": DockerLauncherConfig,
    "kubernetes": KubernetesLauncherConfig,
}


def _module(name: str, part: str):
    """Launcher `name`'s `options` or `backend` module: a backend loads only when its launcher is asked for."""
    if name not in _NAMES:
        raise OptionError("launcher.name", name, f"must be one of {', '.join(_NAMES)}")
    return importlib.import_module(f"launchers.{name}.{part}")


def check(
    options: Mapping[str, Any], scheduler: Mapping[str, Any], nnodes: int | None, paths: Mapping[str, str]
) -> None:
    """The launcher's and the scheduler's rules for a job of `nnodes` nodes under torchrun (None: one
    process, no torchrun) whose config keys `paths` hold host paths; raises OptionError."""
    _module(options["name"], "options").check(options, nnodes, paths)
    schedulers.check(scheduler, options["name"])


def offers(options: Mapping[str, Any]) -> Offers:
    """What the launcher an option node names offers the runtime and the trainer (`trainjob.runtimes.Offers`)."""
    return _module(options["name"], "options").offers(options)


def get(options: Mapping[str, Any], scheduler: Mapping[str, Any] | None = None) -> Launcher:
    """The launcher for a `launcher` option node (a mapping with at least `name`), and on Kubernetes the
    gang `scheduler` its jobs go through."""
    return _module(options["name"], "backend").make(dict(options), dict(scheduler) if scheduler else None)
