"""The `runtime` section (`runtime=torch-distributed`): how many processes on how many nodes torchrun starts,
and the job's shape that follows from it, the launcher and the strategy (`job_shape`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING

from trainer.config.checks import one_of, require
from trainer.config.degrees import Degrees
from trainer.errors import ConfigError
from trainjob.nodes import node_range

RUNTIMES = ("torch-distributed",)


@dataclass
class RuntimeConfig:
    # Each must be > 0 (`trainer.config.validate` checks it before `check()`).
    POSITIVE: ClassVar[tuple[str, ...]] = ("last_call_timeout", "rdzv_timeout", "monitor_interval")
    name: str = MISSING  # the option chosen (torch-distributed: torchrun)
    # null: the GPU count on this machine, or 2 without GPUs.
    nproc_per_node: int | None = None
    # N nodes, or MIN:MAX for an elastic job (torchrun's elastic rendezvous: it goes on when nodes are lost, down
    # to MIN, and takes nodes that join, up to MAX).
    nnodes: Any = 1
    # This node's rank in a fixed-size run started once per node (torchrun's --node-rank); null: the first free
    # node slot of the run directory. A per-node setting: it is not saved in config.yaml.
    node_rank: int | None = None
    max_restarts: int = 0  # times torchrun restarts the workers after a failure (the JobSet's, on Kubernetes)
    rdzv_backend: str = "c10d"  # torchrun's rendezvous backend
    # host:port of node 0; null on one node lets torchrun pick a free local port (--standalone).
    rdzv_endpoint: str | None = None
    rdzv_id: str = "trainjob"  # the rendezvous' id (the run's, shared by its nodes)
    monitor_interval: float = 1.0  # seconds between torchrun's checks of its workers
    # Elastic jobs: seconds the rendezvous waits for more nodes once MIN have joined.
    last_call_timeout: int = 5
    # Seconds a node waits at the rendezvous for the others (torchrun's join_timeout) before it ends, saying
    # how many nodes joined and which never did.
    rdzv_timeout: int = 600

    def check(self) -> None:
        one_of("runtime.name", self.name, RUNTIMES)
        require(self.nproc_per_node is None or self.nproc_per_node > 0, "runtime.nproc_per_node",
                self.nproc_per_node, "must be > 0, or null for one process per GPU (2 without GPUs)")
        try:
            _, most = node_range(self.nnodes)
        except ValueError as e:
            raise ConfigError("runtime.nnodes", self.nnodes, str(e)) from None
        if self.node_rank is not None:
            require(":" not in str(self.nnodes), "runtime.node_rank", self.node_rank,
                    f"runtime.nnodes={self.nnodes} is an elastic range, whose rendezvous assigns each node its "
                    "rank: leave runtime.node_rank unset")
            require(0 <= self.node_rank < most, "runtime.node_rank", self.node_rank,
                    f"must be in [0, runtime.nnodes={self.nnodes})")
        require(self.max_restarts >= 0, "runtime.max_restarts", self.max_restarts, "must be >= 0")


def local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def node_gpus(cfg: Any) -> int:
    """GPUs per node: those a remote launcher asks for, or those on this machine for the local one."""
    name = cfg.launcher.name
    if name == "kubernetes":
        return int(cfg.launcher.resources_per_node.gpu)
    if name == "docker":
        return int(cfg.launcher.gpus_per_node)
    return local_gpu_count()


def nproc_per_node(cfg: Any) -> int:
    """Processes per node: the runtime's setting, else one per GPU; without GPUs, 2 on this machine and 1
    on a remote node (whose cores the launcher does not know)."""
    if cfg.runtime is None:
        return 1
    if cfg.runtime.nproc_per_node is not None:
        return int(cfg.runtime.nproc_per_node)
    return node_gpus(cfg) or (2 if cfg.launcher.name == "local" else 1)


def node_counts(cfg: Any) -> range:
    """The node counts the job may run at: one, or every count of an elastic range."""
    if cfg.runtime is None:
        return range(1, 2)
    fewest, most = node_range(cfg.runtime.nnodes)
    return range(fewest, most + 1)


@dataclass(frozen=True)
class JobShape:
    """The job's shape, read once from its config (`job_shape`): the node counts it may run at (an elastic
    range's every count), its processes per node, and its degrees at the largest world."""

    counts: range
    per_node: int
    dims: Degrees

    @property
    def world(self) -> int:
        """The world size (an elastic job's largest)."""
        return self.per_node * self.counts[-1]


def job_shape(cfg: Any) -> JobShape:
    """The shape of the job `cfg`; raises ConfigError where its strategy cannot lay out its world."""
    counts, per_node = node_counts(cfg), nproc_per_node(cfg)
    world, s = per_node * counts[-1], cfg.strategy
    require((s.tp == 1 and s.pp == 1) or world > 1, "strategy", s.name, f"strategy={s.name} needs more than one "
            f"process: add runtime=torch-distributed (world size is {world})")
    return JobShape(counts, per_node, Degrees.of(s, world))
