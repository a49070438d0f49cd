"""The `runtime` section as the trainer reads it: each runtime's keys, checks and node commands are its unit's
(`trainjob.runtimes`, one module per runtime; `conf/runtime/<name>.yaml`); here the runtime's rules are run
as config errors, and the job's shape follows from the runtime, the launcher's offers and the strategy
(`job_shape`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config.checks import require
from trainer.config.degrees import Degrees
from trainer.errors import ConfigError
from trainjob import runtimes
from trainjob.nodes import node_range
from trainjob.options import OptionError
from trainjob.runtimes import Offers, Runtime


def unit(section: Any) -> Runtime:
    """The runtime unit of a `runtime` section (ConfigError on an unknown name)."""
    try:
        return runtimes.get(section.name)
    except OptionError as e:
        raise ConfigError(e.key, e.value, e.allowed) from None


def local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def node_gpus(offers: Offers) -> int:
    """GPUs per node: those a remote launcher gives each node, or those on this machine."""
    return local_gpu_count() if offers.gpus_per_node is None else offers.gpus_per_node


def nproc_per_node(cfg: Any, offers: Offers) -> int:
    """Processes per node: the runtime's setting, else one per GPU; without GPUs, 2 on this machine and 1
    on a remote node (whose cores the launcher does not know)."""
    if cfg.runtime is None:
        return 1
    if cfg.runtime.nproc_per_node is not None:
        return int(cfg.runtime.nproc_per_node)
    return node_gpus(offers) or (2 if offers.runs_here else 1)


def node_counts(cfg: Any) -> range:
    """The node counts the job may run at: one, or every count of an elastic range."""
    if cfg.runtime is None:
        return range(1, 2)
    fewest, most = node_range(cfg.runtime.nnodes)
    return range(fewest, most + 1)


@dataclass(frozen=True)
class JobShape:
    """The job's shape, read once from its config (`job_shape`): the node counts it may run at (an elastic
    range's every count), its processes per node, its degrees at the largest world, and what the launcher it
    runs under offers."""

    counts: range
    per_node: int
    dims: Degrees
    offers: Offers

    @property
    def world(self) -> int:
        """The world size (an elastic job's largest)."""
        return self.per_node * self.counts[-1]


def job_shape(cfg: Any, offers: Offers) -> JobShape:
    """The shape of the job `cfg` under a launcher that `offers`; raises ConfigError where its runtime refuses
    its keys or its node counts, or its strategy cannot lay out its world."""
    r = cfg.runtime
    if r is not None:
        try:
            unit(r).check(r)
        except OptionError as e:
            raise ConfigError(e.key, e.value, e.allowed) from None
    counts, per_node = node_counts(cfg), nproc_per_node(cfg, offers)
    if r is not None:
        try:
            unit(r).check_job(r, counts, offers)
        except OptionError as e:
            raise ConfigError(e.key, e.value, e.allowed) from None
    world, s = per_node * counts[-1], cfg.strategy
    require((s.tp == 1 and s.pp == 1) or world > 1, "strategy", s.name, f"strategy={s.name} needs more than one "
            f"process: add runtime=torch-distributed (world size is {world})")
    return JobShape(counts, per_node, Degrees.of(s, world), offers)
