"""`recipe.reward_funcs`: `load("package.module:function")` imports one and checks that it can be
called as recipe=grpo and rloo call it, `function(prompts=[...], completions=[...], **columns)`: `prompts` are the
rows' prompts (text, or the `messages` list), `completions` the generated text, one entry per completion (each
prompt repeated `recipe.num_generations` times), and every other column of the rows as a list alike. It returns
one number per completion (`call` checks them). A function that does not take `**kwargs` is given only the columns
it names. The config checks, the prompts corpus and the recipes use this one module; `trainer.rewards.shipped`
holds the reward functions we ship."""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable

from trainer.errors import ConfigError, UserCodeError

KEY = "recipe.reward_funcs"
GIVEN = ("prompts", "completions")


def load(spec: str) -> Callable:
    """The reward function `spec` names; ConfigError when it cannot be imported or called as a reward."""
    module, sep, name = str(spec).partition(":")
    if not sep or not module or not name:
        raise ConfigError(KEY, spec, "each must be package.module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(KEY, spec, f"cannot be imported: {e}") from None
    except AttributeError:
        raise ConfigError(KEY, spec, f"module {module} has no {name}") from None
    if not callable(fn):
        raise ConfigError(KEY, spec, f"{name} is a {type(fn).__name__}, not a function")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn  # a builtin or C function: its calls say what is wrong
    names = [p for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [g for g in GIVEN if g not in params]
    if missing:
        raise ConfigError(KEY, spec, f"must take the keyword arguments prompts and completions (and the rows' "
                          f"other columns, or **kwargs); it has no {', '.join(missing)}")
    positional_only = [p.name for p in names if p.kind == p.POSITIONAL_ONLY]
    if positional_only:
        raise ConfigError(KEY, spec, f"is called with keyword arguments; {', '.join(positional_only)} is "
                          "positional-only")
    return fn


def columns_needed(fn: Callable) -> set[str] | None:
    """The row columns `fn` names (None: it takes **kwargs, so every column, and names none it must have)."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return None
    return {n for n, p in params.items() if n not in GIVEN and p.default is p.empty
            and p.kind != p.VAR_POSITIONAL}


def call(fn: Callable, spec: str, prompts: list, completions: list[str], columns: dict[str, list]) -> list[float]:
    """`fn`'s rewards, checked: one finite number per completion."""
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        columns = {k: v for k, v in columns.items() if k in params}
    try:
        out = fn(prompts=prompts, completions=completions, **columns)
    except Exception as e:  # the user's function failed (a server down, a bug): the loop adds the step
        raise UserCodeError(f"reward function {spec}", e) from e
    values = list(out) if not isinstance(out, str | bytes) else None
    if values is None or len(values) != len(completions):
        raise ConfigError(KEY, spec, f"returned {type(out).__name__} {_short(out)}; it must return one number per "
                          f"completion ({len(completions)})")
    try:
        numbers = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(KEY, spec, f"returned {_short(values)}; each reward must be a number") from None
    if not all(math.isfinite(v) for v in numbers):
        raise ConfigError(KEY, spec, f"returned a reward that is not finite ({_short(numbers)})")
    return numbers


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
