"""The launcher options: each launcher's schema (`LAUNCHER_SCHEMAS`), its and the gang scheduler's rules
(`check`), and the launcher an option node names (`get`). Each launcher's package holds its own schema and
rules (`options`) apart from its backend; this module only chooses among them."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from omegaconf import MISSING

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
    """The launcher's and the scheduler's rules for a job of `nnodes` nodes under a runtime (None: one
    process, no runtime) whose config keys `paths` hold host paths; raises OptionError."""
    _module(options["name"], "options").check(options, nnodes, paths)
    schedulers.check(scheduler, options["name"])


def offers(options: Mapping[str, Any]) -> Offers:
    """What the launcher an option node names offers the runtime and the trainer (`trainjob.runtimes.Offers`)."""
    return _module(options["name"], "options").offers(options)


def get(options: Mapping[str, Any], scheduler: Mapping[str, Any] | None = None) -> Launcher:
    """The launcher for a `launcher` option node (a mapping with at least `name`), and on Kubernetes the
    gang `scheduler` its jobs go through."""
    return _module(options["name"], "backend").make(dict(options), dict(scheduler) if scheduler else None)


def _defaults(schema: type) -> dict[str, Any]:
    """The schema's defaults as plain values (None where it has none)."""
    out = {}
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        else:
            out[f.name] = None if f.default in (dataclasses.MISSING, MISSING) else f.default
    return out


def client_backend(launcher: str, given: Mapping[str, Any]) -> Any:
    """The backend of launcher `launcher` that a Client drives (`launchers.backend.Backend`), with the options it
    was `given` (its other keys at their defaults; never waiting); OptionError on a launcher or a key it has not."""
    if launcher not in LAUNCHER_SCHEMAS:
        raise OptionError("launcher", launcher, f"must be one of {', '.join(LAUNCHER_SCHEMAS)}")
    schema = LAUNCHER_SCHEMAS[launcher]
    known = {f.name for f in dataclasses.fields(schema)} - {"name", "wait", "dry_run"}
    for key in given:
        if key not in known:
            raise OptionError(
                f"launcher.{key}",
                given[key],
                f"unknown option of launcher={launcher}; it has {', '.join(sorted(known))}",
            )
    backend = get({**_defaults(schema), **given, "name": launcher, "wait": False})
    backend.given = dict(given)
    return backend
