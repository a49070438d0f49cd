"""`validate`, every check of a composed config in order: unknown keys, finite numbers, each section's own
`check()`, the job's shape (`runtime.job_shape`: the runtime's rules, under what the launcher offers), the
launcher's and scheduler's rules (`launchers.check`), then the rules across sections (`across.check`).

The driver's side of the config (with `trainer.config.compose`, which registers the schemas in Hydra's
ConfigStore): the one place here that reads the launchers' schemas. A rank types its config.yaml with
`schema.typed` alone and imports no launcher."""

from __future__ import annotations

import os
from dataclasses import fields
from typing import NamedTuple

from omegaconf import DictConfig

import launchers
from launchers import LAUNCHER_SCHEMAS, SchedulerConfig
from trainer.config import across
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


def _known_keys(cfg: DictConfig, chosen: dict[str, type]) -> None:
    # Hydra's `+key=value` appends keys even to a typed node; only the schema's fields are meaningful.
    top = {f.name for f in fields(Config)}
    for key in cfg:
        if key not in top:
            raise ConfigError(str(key), cfg.get(key), f"unknown key; the top level has {', '.join(sorted(top))}")
    for group, schema in chosen.items():
        node = cfg.get(group)
        if node is None:
            continue
        known = {f.name for f in fields(schema)}
        for key in node:
            if key not in known:
                raise ConfigError(f"{group}.{key}", node.get(key),
                                  f"unknown key; {group} has {', '.join(sorted(known))}")


class Validated(NamedTuple):
    """A config that passed every check: the typed `Config`, and its shape (node counts, processes per node,
    degrees), read once."""

    job: Config
    shape: JobShape


def validate(cfg: DictConfig) -> Validated:
    """Check every rule that the types alone cannot; raise ConfigError on the first one broken."""
    chosen = schemas(cfg)
    _known_keys(cfg, chosen)
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
