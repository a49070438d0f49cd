"""`validate`, every check of a composed config in order: unknown keys and keys the chosen options never read
(`readers`), finite numbers, each section's own `check()`, the job's shape (`runtime.job_shape`), the launcher's
and scheduler's rules (`launchers.check`), then the rules across sections (`across.check`).

The driver's side of the config (with `trainer.config.compose`, which registers the schemas in Hydra's
ConfigStore): the one place here that reads the launchers' schemas. A rank types its config.yaml with
`schema.typed` alone and imports no launcher."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf

import launchers
from launchers import LAUNCHER_SCHEMAS, SchedulerConfig
from trainer.config import across, readers
from trainer.config.checks import one_of, require
from trainer.config.runtime import JobShape, job_shape
from trainer.config.schema import SCHEMAS, Config, finite, typed
from trainer.errors import ConfigError
from trainjob import runtimes


def schemas(cfg: DictConfig) -> dict[str, type]:
    """The schema of each section of `cfg`, the chosen launcher's and the gang scheduler's included."""
    chosen = {**SCHEMAS, "scheduler": SchedulerConfig}
    if cfg.launcher.get("name") in LAUNCHER_SCHEMAS:
        chosen["launcher"] = LAUNCHER_SCHEMAS[cfg.launcher.name]
    if cfg.get("runtime") is not None and cfg.runtime.get("name") in runtimes.NAMES:
        chosen["runtime"] = runtimes.get(cfg.runtime.name).schema
    return chosen


def _known_keys(cfg: DictConfig, chosen: dict[str, type], given: Mapping[str, object]) -> None:
    """Refuse a key of `cfg` that no schema has (Hydra's `+key=value` appends keys even to a typed node), and a key
    the user set (`given`: `readers.given_keys`) that the chosen options never read (`readers.table`)."""
    # Each group's option by its name (a section without one, such as train, has one option: any reads its keys).
    options = {group: cfg[group].get("name", "") if OmegaConf.is_config(cfg[group]) else None for group in cfg}
    for key, value in given.items():
        reason = readers.unread(key, options)
        if reason:
            raise ConfigError(key, value, reason)
    for group in cfg:
        node = cfg.get(group)
        if group not in chosen:
            keys = [str(group)]
        else:
            known = {f.name for f in fields(chosen[group])}
            keys = [f"{group}.{k}" for k in node if k not in known] if node is not None else []
        for key in keys:
            reason = readers.unknown(key) or readers.unread(key, options)
            if reason:
                raise ConfigError(key, OmegaConf.select(cfg, key), reason)


class Validated(NamedTuple):
    """A config that passed every check: the typed `Config`, and its shape (node counts, processes per node,
    degrees), read once."""

    job: Config
    shape: JobShape


def validate(cfg: DictConfig, given: Mapping[str, object] | None = None) -> Validated:
    """Check every rule that the types alone cannot; raise ConfigError on the first one broken. `given`: the keys
    the user set (`readers.given_keys`), each refused where the chosen options never read it."""
    chosen = schemas(cfg)
    _known_keys(cfg, chosen, given or {})
    one_of("launcher.name", cfg.launcher.name, tuple(LAUNCHER_SCHEMAS))
    job = typed(cfg, chosen)
    sections = {name: getattr(job, name) for name in chosen if getattr(job, name) is not None}
    finite(sections)
    for name, section in sections.items():
        for key in getattr(type(section), "POSITIVE", ()):  # the fields a section declares must be > 0
            value = getattr(section, key)
            require(value is not None and value > 0, f"{name}.{key}", value, "must be > 0")
        if hasattr(section, "check"):  # the launcher's and scheduler's rules live in launchers/
            section.check()
    shape = job_shape(job, launchers.offers(cfg.launcher))
    # The launcher's and the scheduler's own rules (`launchers.check`), reported as config errors.
    paths = {"hydra.run.dir": os.path.abspath(os.path.expanduser(str(cfg.run_dir))),
             "data.cache_dir": os.path.abspath(os.path.expanduser(str(cfg.data.cache_dir)))}
    try:
        launchers.check(cfg.launcher, cfg.scheduler, shape.counts[-1] if job.runtime is not None else None, paths)
    except launchers.OptionError as e:
        raise ConfigError(e.key, e.value, e.allowed) from None
    across.check(job, shape)
    return Validated(job, shape)
