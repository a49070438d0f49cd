"""`ConfigError`, what every check raises for a config that cannot run, and `UserCodeError`, what a run ends with
when user code raises. It stands alone, importing nothing of the project, so that every part of the trainer
(the run directory's claim, the parallel degrees, the rank side's input checks, the config sections
themselves) raises them without importing the schema."""

from __future__ import annotations

import os
import site
import sys
import traceback
from typing import Any


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}: {allowed}")


# Frames of these folders are the framework's (trainjob's packages, the interpreter's library, site-packages:
# torch, Hydra, ...); the others are the user's own code.
_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(_PROJECT, p) + os.sep for p in ("trainjob", "trainer", "launchers", "datacache", "ops"))
_LIBRARY = tuple({os.path.dirname(os.__file__) + os.sep, sys.prefix + os.sep, sys.base_prefix + os.sep,
                  *(p + os.sep for p in site.getsitepackages() if p)})


class UserCodeError(Exception):
    """User code (a reward function, a chat template, ...) raised `error`. The message is one line naming the
    function, the step and the exception; `frames()` is the traceback of the user's own frames only."""

    def __init__(self, function: str, error: BaseException, step: int | str | None = None):
        self.function, self.error, self.step = function, error, step
        super().__init__(self._line())

    def _line(self) -> str:
        detail = " ".join(str(self.error).split())
        where = "" if self.step is None else f" at step {self.step}" if isinstance(self.step, int) else f" {self.step}"
        return f"{self.function} raised {type(self.error).__name__}{f': {detail}' if detail else ''}{where}"

    def at_step(self, step: int) -> UserCodeError:
        """This error, saying at which training step it happened (where the raiser did not know it)."""
        if self.step is None:
            self.step = step
            self.args = (self._line(),)
        return self

    def frames(self) -> str:
        """'Traceback (the user's frames):' and those frames, innermost last; '' when none is the user's."""
        own = [f for f in traceback.extract_tb(self.error.__traceback__)
               if not f.filename.startswith(_OURS + _LIBRARY) and not f.filename.startswith("<frozen")]
        return "" if not own else "Traceback (your code, most recent call last):\n" + "".join(
            traceback.format_list(own)).rstrip("\n")

    def report(self) -> str:
        """What the run ends with: 'error: <the line>' and the user's frames under it."""
        return "\n".join(part for part in (f"error: {self}", self.frames()) if part)
