"""The helpers the config's checks are written with (`require`, `one_of`: each raises `ConfigError` naming the
key, the value and what is allowed), and `read_by`, the mark of a field only some options of its group read."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from trainer.errors import ConfigError


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    require(value in allowed, key, value, f"must be one of {', '.join(allowed)}")


# The metadata key of a field read by some options of its group only (`read_by`); trainer.config.readers makes
# the table of which option reads which key from it.
READ_BY = "read_by"


def read_by(*options: str, **default: Any) -> Any:
    """A dataclass field (`default=` or `default_factory=`) that only the named options of its section's group
    read; a key the user sets under another option is refused (`trainer.config.readers`)."""
    return field(metadata={READ_BY: options}, **default)
