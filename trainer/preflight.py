"""What is checked before anything starts: `check(cfg)` for one run's config, and `Preflight`, the Hydra
callback that, before Hydra makes a directory, refuses a run or sweep directory that is a file and checks
every job of a `-m` sweep, so that a bad value anywhere in a sweep is refused before its first job runs."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from trainer.config import ConfigError, parallel_dims, validate

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def check(cfg: DictConfig) -> None:
    """Resolve `cfg` in place and check it: the rules, then (where the ranks run on this machine) what the
    data, the checkpoint and the cache nodes say. Raises ConfigError; writes nothing but the corpus cache."""
    run_dir = os.path.abspath(cfg.run_dir)
    OmegaConf.resolve(cfg)
    cfg.run_dir = run_dir
    if cfg.model.name == "hf":  # its model.* keys come from the model directory's config.json
        from trainer.models import hf

        hf.fill_config(cfg.model)
    job = validate(cfg)
    # Where the ranks read this machine's data cache (a docker dry run prints its commands only, and reads nothing).
    if job.launcher.name == "local" or (job.launcher.name == "docker" and not job.launcher.dry_run):
        from trainer import data, worker

        corpus = worker.check_inputs(job, parallel_dims(job))
        if corpus is not None:  # pinned: every rank reads this build, wherever it runs
            cfg.data.fingerprint = data.corpus_key(corpus)
    c = job.data.cache  # a warning only once the config passed: a refusal stays one line
    plain = [e for e in [*c.endpoints, *c.eval_endpoints] if not str(e).startswith("grpc+tls://")]
    if c.token and plain:
        print(f"warning: data.cache.token goes in clear to {', '.join(map(str, plain))}: use grpc+tls:// nodes "
              "(data.cache.tls_root_cert for a private CA) where the network is not trusted", file=sys.stderr)


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_directory(key: str, path: str) -> None:
    """Refuse `path` (the value of `key`) where it, or the nearest part of it that exists, is not a directory."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == os.path.abspath(path) else f"is inside {existing}, which is a file"
        _refuse(f"{key}={path}: {what}; the run writes a directory there")


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
                    check(cfg)
                except ConfigError as e:
                    job = f"sweep job {number}" + (f" ({' '.join(varied)})" if varied else "")
                    _refuse(f"{job}, before any job ran: {e}")
