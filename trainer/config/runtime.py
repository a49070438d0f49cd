"""The `runtime` section as the trainer reads it: each runtime's keys, rules and node commands are its unit's
(`trainjob.runtimes`, one unit per runtime; `conf/runtime/<name>.yaml`); here the unit is looked up once
(`job_shape`, whose `JobShape.unit` the driver carries to the launcher), its rules on its own keys and node counts
are run there as config errors (`check`, `check_job`; those on the rest of the run, `check_run`, among the
cross-section rules: `trainer.config.across`), and the job's shape follows from the runtime, the launcher's offers
and the strategy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainer.config.checks import require
from trainer.config.degrees import Degrees
from trainer.errors import ConfigError
from trainjob import runtimes
from trainjob.nodes import local_gpus, node_range
from trainjob.options import OptionError
from trainjob.runtimes import Offers, Runtime


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """A runtime's OptionError, reported as the config error it is (one line naming key, value and what is
    allowed)."""
    try:
        yield
    except OptionError as e:
        raise ConfigError(e.key, e.value, e.allowed) from None


def node_gpus(offers: Offers) -> int:
    """GPUs per node: those a remote launcher gives each node, or those on this machine."""
    return local_gpus() if offers.gpus_per_node is None else offers.gpus_per_node


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
    range's every count), its processes per node, its degrees at the largest world, what the launcher it
    runs under offers, and its runtime's unit (None: no runtime), looked up once and carried to the launcher."""

    counts: range
    per_node: int
    dims: Degrees
    offers: Offers
    unit: Runtime | None = None

    @property
    def world(self) -> int:
        """The world size (an elastic job's largest)."""
        return self.per_node * self.counts[-1]


def job_shape(cfg: Any, offers: Offers) -> JobShape:
    """The shape of the job `cfg` under a launcher that `offers`; raises ConfigError where its runtime refuses
    its keys or its node counts, or its strategy cannot lay out its world."""
    r, unit = cfg.runtime, None
    if r is not None:
        with config_errors():
            unit = runtimes.get(r.name)
            unit.check(r)
    counts, per_node = node_counts(cfg), nproc_per_node(cfg, offers)
    if unit is not None:
        with config_errors():
            unit.check_job(r, counts, offers)
    world, s = per_node * counts[-1], cfg.strategy
    require((s.tp == 1 and s.pp == 1 and s.cp == 1) or world > 1, "strategy", s.name,
            f"strategy={s.name} needs more than one process: add runtime=torch-distributed (world size is {world})")
    return JobShape(counts, per_node, Degrees.of(s, world), offers, unit)
