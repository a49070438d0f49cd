"""A package face whose names load on first use: `__getattr__ = lazy.names(__name__, homes)` in its
`__init__`, with `homes` naming the module each name lives in. Importing the package then loads none of its
modules, so that reading one light module of it (a schema, a constant) does not pull in its heavy ones."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def names(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The module-level `__getattr__` of `package` that imports `homes[name]` when `name` is first read."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__
