"""The Docker launcher: `options` (the schema and its checks) and `backend` (the containers a run becomes,
started, watched and removed through the docker CLI). Its names load on first use, so that reading the
options' schema loads no backend."""

from __future__ import annotations

from trainjob import lazy

_HOMES = {"DockerLauncherConfig": "launchers.docker.options", "check": "launchers.docker.options",
          "make": "launchers.docker.backend"}

__all__ = sorted(_HOMES)

__getattr__ = lazy.names(__name__, _HOMES)
