"""The two helpers the config's checks are written with; each raises `ConfigError` naming the key, the value
and what is allowed."""

from __future__ import annotations

from typing import Any

from trainer.errors import ConfigError


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    require(value in allowed, key, value, f"must be one of {', '.join(allowed)}")


