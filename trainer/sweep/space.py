"""The search space of an Optuna sweep, in the syntax of Hydra's Optuna plugin: `interval(a, b)` (a float
between a and b), `tag(log, interval(a, b))` (the same, sampled on a log scale), `range(start, stop[,
step])` (integers, or the listed floats), `choice(x, y, ...)` and `x,y,...` (one of the values). They come
from `hydra.sweeper.params` and from the command line (which wins for a key given in both); every other
override is passed unchanged to each trial."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.errors import ConfigError


@dataclass(frozen=True)
class Space:
    """The distributions to sample (`optuna.distributions`, by key) and the overrides every trial gets."""

    distributions: dict[str, Any]
    fixed: list[str]

    def grid(self) -> dict[str, list]:
        """Every value of each key, for the grid sampler; ConfigError for an interval (no grid of it)."""
        from optuna.distributions import CategoricalDistribution, IntDistribution

        grid = {}
        for key, dist in self.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                grid[key] = list(dist.choices)
            elif isinstance(dist, IntDistribution) and not dist.log:
                grid[key] = list(range(dist.low, dist.high + 1, dist.step))
            else:
                raise ConfigError(
                    "hydra.sweeper.sampler",
                    "grid",
                    f"{key} is an interval; a grid takes choice(...) or range(...) of each key",
                )
        return grid


def _distribution(key: str, override) -> Any:
    """The Optuna distribution of one sweep override (`interval`, `range`, `choice`, tagged `log` or not)."""
    from hydra.core.override_parser.types import Transformer
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    log = "log" in getattr(value, "tags", set())
    if override.is_interval_sweep():
        low, high = float(value.start), float(value.end)
        if not low < high or (log and low <= 0):
            raise ConfigError(
                key,
                override.get_value_element_as_str(),
                f"an interval needs start < end{' and start > 0 on a log scale' if log else ''}",
            )
        return FloatDistribution(low, high, log=log)
    if getattr(value, "shuffle", False):
        raise ConfigError(key, override.get_value_element_as_str(), "shuffle(...) means nothing to Optuna")
    values = list(override.sweep_iterator(transformer=Transformer.encode))
    if not values:
        raise ConfigError(key, override.get_value_element_as_str(), "an empty range or choice")
    if override.is_range_sweep() and all(isinstance(v, int) for v in values):
        step = values[1] - values[0] if len(values) > 1 else 1
        return IntDistribution(values[0], values[-1], log=log and step == 1, step=1 if log else step)
    return CategoricalDistribution(values)


def parse(params: dict[str, Any] | None, arguments: list[str]) -> Space:
    """The space of `hydra.sweeper.params` and the command line's overrides (`arguments`); ConfigError naming
    the override that Hydra's parser or Optuna cannot take."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    given = [f"{k}={v}" for k, v in (params or {}).items()]
    try:
        parsed = OverridesParser.create().parse_overrides([*given, *arguments])
    except HydraException as e:
        raise ConfigError("hydra.sweeper.params", " ".join(given + arguments), str(e).splitlines()[0]) from None
    distributions: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in parsed:  # a later override of a key (the command line's) replaces an earlier one
        key = override.get_key_element()
        distributions.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            distributions[key] = _distribution(key, override)
        else:
            fixed[key] = f"{key}={override.get_value_element_as_str()}"
    return Space(distributions, list(fixed.values()))


def as_override(key: str, value: Any) -> str:
    """A sampled value as a trial's override (a float in full, a string quoted where Hydra would misread it)."""
    if isinstance(value, str):
        return f"{key}={value}"
    return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"
