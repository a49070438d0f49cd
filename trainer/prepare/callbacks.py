"""The Hydra callback trainjob registers (conf/config.yaml's hydra.callbacks): `Preflight`, which, before Hydra
makes a directory, refuses a run or sweep directory that cannot be one and checks every job of a `-m` sweep
(`trainer.prepare.preflight.check`), so that a bad value anywhere in a sweep is refused before its first job runs."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from trainer.config import ConfigError, readers
from trainer.prepare.preflight import check
from trainer.prepare.run_dir import note_before_making
from trainjob.files import directory_problem

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_directory(key: str, path: str) -> None:
    """Refuse `path` (the value of `key`) where it cannot become a directory this process writes in (a file,
    inside a file, read-only); else note what of it exists, so that a refused run removes only what Hydra
    makes of it."""
    problem = directory_problem(path)
    if problem:
        _refuse(f"{key}={path}: {problem}; the run writes a directory there")
    note_before_making(path)


def _sweep_jobs(hydra_cfg: DictConfig) -> list[tuple[list[str], list[str]]] | None:
    """Each job's overrides, as Hydra's basic sweeper will run them, with those of them that the sweep varies
    (what tells the jobs apart); None for another sweeper (Optuna picks its points as it goes, and each job
    is checked when it starts)."""
    if hydra_cfg.sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    params = [f"{k}={v}" for k, v in (hydra_cfg.sweeper.get("params") or {}).items()]
    arguments = [*params, *OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)]
    try:
        parsed = OverridesParser.create().parse_overrides(arguments)
        batches = BasicSweeper.split_arguments(parsed, None)
    except HydraException:
        return None  # Hydra's sweeper says what is wrong with them
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    return [(job, [o for o in job if o.split("=", 1)[0] in swept]) for batch in batches for job in batch]


class Preflight(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_directory("hydra.run.dir", config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs: Any) -> None:
        _check_directory("hydra.sweep.dir", config.hydra.sweep.dir)
        jobs = _sweep_jobs(config.hydra)
        if not jobs:
            return
        from hydra import compose

        with tempfile.TemporaryDirectory() as scratch:
            for number, (overrides, varied) in enumerate(jobs):
                cfg = compose(config_name=config_name, overrides=overrides)
                with open_dict(cfg):
                    cfg.run_dir = os.path.join(scratch, str(number))
                try:
                    check(cfg, readers.given_keys(overrides))
                except ConfigError as e:
                    job = f"sweep job {number}" + (f" ({' '.join(varied)})" if varied else "")
                    _refuse(f"{job}, before any job ran: {e}")
