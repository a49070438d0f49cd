"""What is checked before anything starts: `check(cfg)` for one run's config, and `Preflight`, the Hydra
callback that, before Hydra makes a directory, refuses a run or sweep directory that is a file and checks
every job of a `-m` sweep, so that a bad value anywhere in a sweep is refused before its first job runs."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from trainer.config import Config, ConfigError, parallel_dims
from trainer.config.hf_impl import fill_config
from trainer.config.validate import validate
from trainer.run_dir import note_before_making
from trainjob.files import directory_problem

if TYPE_CHECKING:
    from trainer import inputs

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def check(cfg: DictConfig) -> tuple[Config, inputs.Checked | None]:
    """Resolve `cfg` in place and check it: the rules, then (where the ranks run on this machine) what the
    data, the checkpoint and the cache nodes say. Raises ConfigError; writes nothing but the corpus cache.
    Returns the typed config (built once, here) and what the input checks found, or None where they did not
    run here."""
    run_dir = os.path.abspath(cfg.run_dir)
    _resolve(cfg)
    cfg.run_dir = run_dir
    if cfg.model.name == "hf":  # its model.* keys come from the model directory's config.json
        fill_config(cfg.model)
    job = validate(cfg)
    checked = None
    # Where the ranks read this machine's data cache (a docker dry run prints its commands only, and reads nothing).
    if job.launcher.name == "local" or (job.launcher.name == "docker" and not job.launcher.dry_run):
        from trainer import inputs
        from trainer.data.corpus import corpus_key

        problem = directory_problem(job.data.cache_dir)
        if problem:
            raise ConfigError("data.cache_dir", job.data.cache_dir, f"{problem}; the corpus is cached there "
                              "(its default is $TRAINJOB_CACHE, else ~/.cache/trainjob)")

        checked = inputs.check(job, parallel_dims(job))
        if checked.corpus is not None:  # pinned: every rank reads this build, wherever it runs
            cfg.data.fingerprint = job.data.fingerprint = corpus_key(checked.corpus)
    c = job.data.cache  # a warning only once the config passed: a refusal stays one line
    plain = [e for e in [*c.endpoints, *c.eval_endpoints] if not str(e).startswith("grpc+tls://")]
    if c.token and plain:
        print(f"warning: data.cache.token goes in clear to {', '.join(map(str, plain))}: use grpc+tls:// nodes "
              "(data.cache.tls_root_cert for a private CA) where the network is not trusted", file=sys.stderr)
    return job, checked


def _unresolvable(node: Any, prefix: str = "") -> str | None:
    """The dotted key of the first value of `node` that cannot be resolved, or None."""
    for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
        path = f"{prefix}.{key}" if prefix and isinstance(node, DictConfig) else (
            f"{prefix}[{key}]" if prefix else str(key))
        try:
            child = node[key]
        except InterpolationResolutionError:
            return path
        if isinstance(child, (DictConfig, ListConfig)):
            found = _unresolvable(child, path)
            if found:
                return found
    return None


def _resolve(cfg: DictConfig) -> None:
    """Resolve `cfg` in place; a value that cannot be resolved (an environment variable that is not set,
    such as HOME for the default data.cache_dir) is a ConfigError on its key."""
    try:
        OmegaConf.resolve(cfg)
    except InterpolationResolutionError as e:
        reason = re.sub(r"^\w+ raised while resolving interpolation: ", "", str(e).splitlines()[0]).strip("\"")
        key = e.full_key or _unresolvable(cfg) or "?"
        node, leaf = (cfg, key) if "." not in key else (OmegaConf.select(cfg, key.rsplit(".", 1)[0]),
                                                        key.rsplit(".", 1)[1])
        raw = node._get_node(leaf)._value() if isinstance(node, DictConfig) and leaf in node else None
        raise ConfigError(key, raw, f"cannot be resolved: {reason}: set it, or give {key} a value") from None


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
                    check(cfg)
                except ConfigError as e:
                    job = f"sweep job {number}" + (f" ({' '.join(varied)})" if varied else "")
                    _refuse(f"{job}, before any job ran: {e}")
