"""`ConfigError`, what every check raises for a config that cannot run. It stands alone, importing nothing of
the project, so that every part of the trainer (the run directory's claim, the parallel degrees, the rank
side's input checks, the config sections themselves) raises it without importing the schema."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}: {allowed}")
