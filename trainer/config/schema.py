"""`Config`, the whole schema: one field per config group, each typed by its section's dataclass; its
registration in Hydra's ConfigStore, and `typed`, a composed config as those dataclasses."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from launchers import LAUNCHER_SCHEMAS, SchedulerConfig
from trainer.config.data import DataConfig
from trainer.config.kernels import KernelsConfig
from trainer.config.model import ModelConfig
from trainer.config.optim import OptimConfig
from trainer.config.peft import PeftConfig
from trainer.config.recipe import RecipeConfig
from trainer.config.runtime import RuntimeConfig
from trainer.config.strategy import StrategyConfig
from trainer.config.train import TrainConfig
from trainer.errors import ConfigError


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    strategy: StrategyConfig = MISSING
    # Each launcher option has its own schema (launchers.LAUNCHER_SCHEMAS), named in its yaml's defaults list.
    launcher: Any = MISSING
    scheduler: SchedulerConfig = MISSING
    kernels: KernelsConfig = MISSING
    optim: OptimConfig = MISSING
    train: TrainConfig = MISSING
    recipe: RecipeConfig = MISSING
    peft: PeftConfig = MISSING
    runtime: RuntimeConfig | None = None
    run_dir: str = "${hydra:runtime.output_dir}"


LAUNCHERS = tuple(LAUNCHER_SCHEMAS)


def _kind(hint: Any) -> Any:
    """The one type a field holds (`X | None` gives X), or None for a union of several."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [k for k in (typing.get_args(hint) if union else (hint,)) if k is not type(None)]
    return kinds[0] if len(kinds) == 1 else None


# The schema of each section with one (all but the launcher, whose schema depends on its name).
SCHEMAS = {name: _kind(hint) for name, hint in typing.get_type_hints(Config).items() if is_dataclass(_kind(hint))}


def register() -> None:
    """Put the schemas into Hydra's ConfigStore; `conf/config.yaml` starts its defaults with `schema`."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for name, schema in LAUNCHER_SCHEMAS.items():
        cs.store(name=f"launcher_schema_{name}", node=schema)  # not a launcher option: no group


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


def schemas(cfg: DictConfig) -> dict[str, type]:
    """The schema of each section of `cfg`, the chosen launcher's included."""
    chosen = dict(SCHEMAS)
    if cfg.launcher.get("name") in LAUNCHER_SCHEMAS:
        chosen["launcher"] = LAUNCHER_SCHEMAS[cfg.launcher.name]
    return chosen


def typed(cfg: DictConfig | dict) -> Config:
    """`cfg` (composed, or a resolved config.yaml as loaded) as the typed `Config` of dataclasses, resolved."""
    node = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    launcher = LAUNCHER_SCHEMAS.get(node.launcher.get("name"))
    if launcher is not None:  # `launcher: Any` in the schema: type it by its name
        node.launcher = OmegaConf.merge(OmegaConf.structured(launcher), node.launcher)
    try:
        return OmegaConf.to_object(node)
    except MissingMandatoryValue as e:
        raise ConfigError(e.full_key, "???", "must be set") from None
