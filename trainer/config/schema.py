"""`Config`, the whole schema: one field per config group, each typed by its section's dataclass; `typed`, a
composed config as those dataclasses; `finite`, the check that their numbers are numbers a run can take.

The launcher's and the gang scheduler's schemas live in `launchers/` and only the driver reads them
(`trainer.config.validate`): here those two sections are `Any`, and a rank keeps them as the nodes they were
composed as, so that a rank imports no launcher."""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from trainer.config.checks import require
from trainer.config.data import DataConfig
from trainer.config.kernels import KernelsConfig
from trainer.config.lr_schedule import LRScheduleConfig
from trainer.config.model import ModelConfig
from trainer.config.optim import OptimConfig
from trainer.config.peft import PeftConfig
from trainer.config.recipe import RecipeConfig
from trainer.config.strategy import StrategyConfig
from trainer.config.tracker import TrackerConfig
from trainer.config.train import TrainConfig
from trainer.errors import ConfigError
from trainjob import runtimes
from trainjob.options import OptionError


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    strategy: StrategyConfig = MISSING
    # Each launcher option has its own schema (launchers.LAUNCHER_SCHEMAS), named in its yaml's defaults list;
    # the gang scheduler's is launchers.SchedulerConfig.
    launcher: Any = MISSING
    scheduler: Any = MISSING
    kernels: KernelsConfig = MISSING
    optim: OptimConfig = MISSING
    lr_schedule: LRScheduleConfig = MISSING
    train: TrainConfig = MISSING
    tracker: TrackerConfig = MISSING
    recipe: RecipeConfig = MISSING
    peft: PeftConfig = MISSING
    # Each runtime has its own schema (trainjob.runtimes: one module per runtime), chosen by runtime.name; null:
    # this process alone.
    runtime: Any = None
    run_dir: str = "${hydra:runtime.output_dir}"


def _kind(hint: Any) -> Any:
    """The one type a field holds (`X | None` gives X), or None for a union of several."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [k for k in (typing.get_args(hint) if union else (hint,)) if k is not type(None)]
    return kinds[0] if len(kinds) == 1 else None


# The schema of each section with one here (all but the launcher and the scheduler, whose schemas the driver adds).
SCHEMAS = {name: _kind(hint) for name, hint in typing.get_type_hints(Config).items() if is_dataclass(_kind(hint))}
OPTION_SECTIONS = ("launcher", "scheduler")


def numeric_keys(schema: type, prefix: str) -> list[tuple[str, type]]:
    """(dotted key, int or float) for every number-valued field of `schema` (a dataclass), nested ones too."""
    keys = []
    for name, hint in typing.get_type_hints(schema).items():
        kind = _kind(hint)
        if kind in (int, float):
            keys.append((f"{prefix}.{name}", kind))
        elif is_dataclass(kind):
            keys.extend(numeric_keys(kind, f"{prefix}.{name}"))
    return keys


def typed(cfg: DictConfig | dict, options: Mapping[str, type] | None = None) -> Config:
    """`cfg` (composed, or a resolved config.yaml as loaded) as the typed `Config` of dataclasses, resolved.
    `options`: the schemas of the launcher and scheduler sections (the driver's, from `launchers`); a section
    without one stays a node (a DictConfig, resolved), read by its keys as a dataclass would be."""
    node = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    if OmegaConf.is_config(node.runtime):  # every side reads the runtimes' schemas (trainjob, no launcher)
        try:
            schema = runtimes.get(node.runtime.get("name")).schema
        except OptionError as e:
            raise ConfigError(e.key, e.value, e.allowed) from None
        node.runtime = OmegaConf.merge(OmegaConf.structured(schema), node.runtime)
    kept = {}
    for name in OPTION_SECTIONS:
        schema = (options or {}).get(name)
        if schema is not None:
            node[name] = OmegaConf.merge(OmegaConf.structured(schema), node[name])
        elif not OmegaConf.is_missing(node, name) and OmegaConf.is_config(node[name]):
            kept[name] = OmegaConf.create(OmegaConf.to_container(node[name], resolve=True))
            node[name] = None
    try:
        job = OmegaConf.to_object(node)
    except MissingMandatoryValue as e:
        raise ConfigError(e.full_key, "???", "must be set") from None
    for name, section in kept.items():
        setattr(job, name, section)
    return job


def finite(sections: Mapping[str, Any]) -> None:
    """Raise ConfigError on a number of the typed `sections` (name -> dataclass) that is not finite, or an
    integer beyond 64 bits."""
    for prefix, section in sections.items():
        for f in fields(section):
            value, key = getattr(section, f.name), f"{prefix}.{f.name}"
            if is_dataclass(value):
                finite({key: value})
            elif isinstance(value, float):
                require(math.isfinite(value), key, value, "must be a finite number")
            elif isinstance(value, int) and not isinstance(value, bool):
                require(-(2**63) <= value < 2**63, key, value, "must be within a 64-bit integer")
