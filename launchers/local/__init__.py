"""The local launcher: `options` (the schema and its checks) and `backend` (torchrun processes on this machine,
or the run in this process, and the cache nodes beside them). Its names load on first use, so that reading the
options' schema loads no backend."""

from __future__ import annotations

from trainjob import lazy

_HOMES = {"LocalLauncherConfig": "launchers.local.options", "check": "launchers.local.options",
          **dict.fromkeys(("make", "LocalLauncher", "InProcessLauncher"), "launchers.local.backend")}

__all__ = sorted(_HOMES)

__getattr__ = lazy.names(__name__, _HOMES)
