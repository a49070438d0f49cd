"""`ConfigError`, what every check raises for a config that cannot run. It stands alone so that the sections
the schema is made of (`trainer.peft_config`, `trainer.recipes.config`, `trainer.tracking`,
`trainer.parallel.dims`) raise it without importing the schema that imports them."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}: {allowed}")
