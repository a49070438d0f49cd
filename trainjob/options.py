"""`OptionError`, what a launcher's or a runtime's own rules raise for an option that cannot run (the trainer
reports it as its config error: one line naming the key, the value and what is allowed), and `require`."""

from __future__ import annotations

from typing import Any


class OptionError(ValueError):
    """A launcher, scheduler or runtime option that cannot run; the message names the key, the value and what
    is allowed (the trainer reports it as its own config error)."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}: {allowed}")


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise OptionError(key, value, allowed)
