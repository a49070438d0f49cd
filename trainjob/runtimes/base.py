"""What a runtime is: `Runtime`, the one unit that says how a job's ranks start on its nodes and find each
other. Each runtime is one module of `trainjob/runtimes/` holding its subclass and the schema of its keys
(`conf/runtime/<name>.yaml` holds their values). A runtime declares

- its keys, with their defaults and their own checks (`schema`, `check`), and the rules it sets on the job's
  shape and on the launcher it runs under (`check_job`, given what the launcher `Offers`);
- how one node's processes start (`node_command`: the agent's command line, `agent_env`: its environment)
  and the environment contract its ranks read (`rank_env`: its variables as torch.distributed's env://
  names, so that a rank joins the process group the same way under every runtime);
- what it can do (`elastic`, `restarts`, `function_jobs`, `strategies`, `hosts_over_ssh`);
- the Kubeflow Trainer runtime it maps to (`runtime_ref`, `framework`, `ml_policy`).

Nothing here imports torch or the rest of the project: the driver, the launchers and the ranks all read it.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

# Kubeflow Trainer's port for every runtime's coordinator (its ContainerTrainerPort): on a cluster; on this
# machine a free port instead (29500 may be taken here).
KUBEFLOW_PORT = 29500
LOCALHOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on this machine's loopback now."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]

# The interpreter's arguments of a trainer rank: its agent passes the rank's own exit code on.
TRAINER_WORKER = ["-m", "trainer.worker"]


@dataclass(frozen=True)
class Offers:
    """What a launcher offers the runtime and the trainer, as data (each launcher's `offers(options)`):

    `runs_here`: its ranks run on this machine (its GPUs, its installed packages, its processes);
    `gpus_per_node`: GPUs a node gets (None: this machine's);
    `reads_disk_here`: its ranks read and write this machine's disk (the data cache, the run directory), so
    the inputs are checked here and the driver reads the run's files;
    `in_process`: it can run a job without a runtime in the driver's own process;
    `elastic`: it can run an elastic node range;
    `restarts_nodes`: it restarts a failed node itself (not the runtime's agent);
    `kubeflow_cache`: Kubeflow Trainer's data cache runs there;
    `nodes_started_here`: a multi-node run is started once per node on this machine;
    `ssh_hosts`: it lays out a job as one launcher and hosts it reaches over SSH (what an MPI job needs:
    the hostfile and the job's keys, as Kubeflow's MPI plugin writes them and the docker launcher does);
    `cpus_here`: its ranks share this machine's CPUs (a sweep gives each trial running at once its own share)."""

    runs_here: bool = False
    gpus_per_node: int | None = 0
    reads_disk_here: bool = False
    in_process: bool = False
    elastic: bool = True
    restarts_nodes: bool = False
    kubeflow_cache: bool = False
    nodes_started_here: bool = False
    ssh_hosts: bool = False
    cpus_here: bool = False


@dataclass(frozen=True)
class Nodes:
    """A job's layout as one node's agent starts it: `command` (the interpreter's arguments every rank
    runs, such as `-m trainer.worker <config>`) run by `python`, `nproc_per_node` processes on each of
    `nnodes` nodes (`min_nodes`: an elastic range's fewest); `endpoint` is where the ranks meet (host:port of
    node 0, or of a store apart from the nodes, `store_apart`); `hosts` the nodes' host names, in the order the
    ranks are placed on them (rank 0's first), where the runtime starts every node's ranks from one launcher (MPI;
    the launcher's environment names the hostfile that lists them); `node`, where every node runs on a host of its
    own (a container) and its command starts that node alone: its index."""

    command: list[str]
    python: str = "python"
    nnodes: int = 1
    nproc_per_node: int = 1
    min_nodes: int | None = None
    endpoint: str | None = None
    store_apart: bool = False
    hosts: tuple[str, ...] = ()
    node: int | None = None
    # The environment variables the ranks of every node get from the agent's environment (for a runtime that
    # starts remote ranks from one launcher: they do not inherit it).
    env_names: tuple[str, ...] = ()

    @property
    def trainer_run(self) -> bool:
        return self.command[:2] == TRAINER_WORKER


class Runtime(ABC):
    """A runtime (see the module's docstring); subclasses set the class attributes and the methods that
    differ."""

    name: ClassVar[str]
    schema: ClassVar[type]
    # Kubeflow Trainer: the ClusterTrainingRuntime it maps to, and that runtime's framework label.
    runtime_ref: ClassVar[str]
    framework: ClassVar[str]
    elastic: ClassVar[bool] = False
    restarts: ClassVar[bool] = False  # its agent restarts failed ranks (runtime.max_restarts)
    function_jobs: ClassVar[bool] = False  # it runs a user function (Client.train(func=...))
    # The strategies it runs (None: every strategy but those another runtime owns); `owns`: strategies only
    # it runs.
    strategies: ClassVar[tuple[str, ...] | None] = None
    owns: ClassVar[tuple[str, ...]] = ()
    hosts_over_ssh: ClassVar[bool] = False  # one launcher starts every node's ranks over SSH (MPI)
    # It runs a user's function only (no `python -m trainer` run): `check` refuses a trainer run.
    function_only: ClassVar[bool] = False
    # Kubernetes: the TrainJob runs on a TrainingRuntime derived from the cluster's (the failure policies, a
    # gang scheduler's pod group); False: it names the shipped ClusterTrainingRuntime itself, as the SDK does.
    derives_runtime: ClassVar[bool] = True
    # The image of the shipped ClusterTrainingRuntime's trainer container (its kustomize overlay tags it v2.3.0).
    kubeflow_image: ClassVar[str] = ""
    # What its ranks import (the pip distributions' import names) and load by name (shared libraries), beyond
    # torch, and the optional extra of pyproject.toml that installs them: a launcher that runs an image checks the
    # image holds them before the job starts.
    imports: ClassVar[tuple[str, ...]] = ()
    libraries: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str] = ""

    @abstractmethod
    def check(self, options: Any) -> None:
        """The rules on the runtime's own keys (a typed `schema`); raises trainjob.options.OptionError."""

    @abstractmethod
    def check_job(self, options: Any, counts: range, offers: Offers) -> None:
        """The rules on the job's node counts `counts` under a launcher that `offers`; raises OptionError."""

    def missing(self) -> str | None:
        """What this machine lacks to start the runtime's ranks (a line saying how to install it), or None."""
        return None

    @abstractmethod
    def node_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        """The command line one node's agent runs to start its ranks (or, where `hosts_over_ssh`, the
        launcher's command that starts every node's)."""

    @abstractmethod
    def kubeflow_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        """The command of a Kubeflow TrainJob's trainer (`spec.trainer.command`) on this runtime, whose plugin
        sets the nodes' environment (`nodes.python` runs the ranks; no endpoint or host: Kubeflow's)."""

    def agent_env(self, options: Mapping[str, Any]) -> dict[str, str]:
        """Environment for the agent `node_command` starts."""
        return {}

    def install_command(self, packages: list[str], python: str) -> list[str]:
        """A Kubeflow node's command that pip-installs `packages` for the user once per node (every pod runs it
        before the ranks; under MPI the launcher runs it once on each host)."""
        return [python, "-m", "pip", "install", "--quiet", "--no-warn-script-location", "--user", *packages]

    def rank_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The rank's place in the job from the runtime's own variables, as torch.distributed's env:// names
        (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); {} where the environment names none."""
        return {}

    def ml_policy(self, options: Mapping[str, Any], nnodes: int, nproc_per_node: int) -> dict[str, Any]:
        """The TrainingRuntime's `mlPolicy` for a job of `nnodes` nodes of `nproc_per_node` processes."""
        return {"numNodes": nnodes}
