"""What is checked before anything starts: `check(cfg)` for one run's config (a sweep's jobs are checked by it
too, before the first runs: `trainer.prepare.callbacks.Preflight`)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from trainer.config import Config, ConfigError, JobShape
from trainer.config.hf import local_model
from trainer.config.hf_impl import fill_config
from trainer.config.validate import validate
from trainjob.files import directory_problem
from trainjob.storage.urls import is_url

if TYPE_CHECKING:
    from trainer.prepare.inputs import Checked


def check(cfg: DictConfig, given: Mapping[str, object] | None = None) -> tuple[Config, JobShape, Checked | None]:
    """Resolve `cfg` in place and check it: the rules, then (where the ranks run on this machine) what the
    data, the checkpoint and the cache nodes say. Raises ConfigError; writes nothing but the corpus cache.
    Returns the typed config and its shape (each read once, here) and what the input checks found, or None
    where they did not run here. `given`: the keys the user set (`readers.given_keys`), refused where the chosen
    options never read them."""
    run_dir = os.path.abspath(cfg.run_dir)
    _resolve(cfg)
    cfg.run_dir = run_dir
    if cfg.model.name == "hf":  # its model.* keys come from the model directory's config.json
        # A URL is fetched here, once: the config names the local copy, which the ranks read (it lies under
        # data.cache_dir, which Docker's containers mount). On a cluster the config keeps the URL: Kubeflow's
        # model initializer fetches it there (launchers/kubernetes/initializers.py).
        named = cfg.model.path
        cfg.model.path = local_model(named, "model.path", cfg.data.cache_dir)
        fill_config(cfg.model)
    if cfg.train.checkpoint_dir and not is_url(cfg.train.checkpoint_dir):
        cfg.train.checkpoint_dir = os.path.abspath(cfg.train.checkpoint_dir)
    job, shape = validate(cfg, given)
    if cfg.model.name == "hf" and not shape.offers.reads_disk_here:
        cfg.model.path = job.model.path = named
    checked = None
    # Where the ranks read this machine's data cache (a docker dry run prints its commands only, and reads nothing).
    if shape.offers.reads_disk_here:
        from trainer.data.corpus import corpus_key
        from trainer.prepare import inputs

        problem = directory_problem(job.data.cache_dir)
        if problem:
            raise ConfigError("data.cache_dir", job.data.cache_dir, f"{problem}; the corpus is cached there "
                              "(its default is $TRAINJOB_CACHE, else ~/.cache/trainjob)")

        checked = inputs.check(job, shape.dims)  # where the run starts decided here; carried in process
        if checked.corpus is not None:  # pinned: every rank reads this build, wherever it runs
            cfg.data.fingerprint = job.data.fingerprint = corpus_key(checked.corpus)
    c = job.data.cache  # a warning only once the config passed: a refusal stays one line
    plain = [e for e in [*c.endpoints, *c.eval_endpoints] if not str(e).startswith("grpc+tls://")]
    if c.token and plain:
        print(f"warning: data.cache.token goes in clear to {', '.join(map(str, plain))}: use grpc+tls:// nodes "
              "(data.cache.tls_root_cert for a private CA) where the network is not trusted", file=sys.stderr)
    return job, shape, checked


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
