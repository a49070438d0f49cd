"""What a runtime is: `Runtime`, the one unit that says how a job's ranks start on its nodes and find each
other. Each runtime is one module or folder of `trainjob/runtimes/` holding its subclass and the schema of its
keys (`conf/runtime/<name>.yaml` holds their values). A runtime declares

- its keys, with their defaults and their own checks (`schema`, `check`), and every rule it sets on the job:
  on its shape and the launcher it runs under (`check_job`, given what the launcher `Offers`), on the strategy,
  the checkpoints, the data cache and this machine (`check_run`, given the `RunFacts` it reads);
- how one node's processes start (`node_command`: the agent's command line, `agent_env`: its environment; an
  elastic run's rendezvous store, `store_command`; the SSH hosts of a runtime that starts every node's ranks from
  one launcher, `ssh_hosts`) and the environment contract its ranks read (`rank_env`: its variables as
  torch.distributed's env:// names, so that a rank joins the process group the same way under every runtime);
- what it can do (`elastic`, `restarts`, `function_jobs`, `strategies`, `hosts_over_ssh`);
- the Kubeflow Trainer runtime it maps to (`runtime_ref`, `framework`, `ml_policy`), and how the Client
  describes it (`describe`: a `RuntimeInfo`, as Kubeflow's SDK says of a runtime).

Nothing here imports torch or the rest of the project: the driver, the launchers and the ranks all read it. The
command the ranks run is the caller's (`Nodes.command`); where it runs the trainer's worker, the caller names that
module (`Nodes.worker`), so that the runtime chooses its agent without naming a module above it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from trainjob.nodes import node_range
from trainjob.options import OptionError, require

# Kubeflow Trainer's port for every runtime's coordinator (its ContainerTrainerPort): on a cluster; on this
# machine a free port instead (29500 may be taken here).
KUBEFLOW_PORT = 29500


def check_counts(options: Any) -> int:
    """runtime.nproc_per_node and runtime.nnodes (N or MIN:MAX) as every runtime reads them; the most nodes."""
    require(options.nproc_per_node is None or options.nproc_per_node > 0, "runtime.nproc_per_node",
            options.nproc_per_node, "must be > 0, or null for one process per GPU (2 without GPUs)")
    try:
        return node_range(options.nnodes)[1]
    except ValueError as e:
        raise OptionError("runtime.nnodes", options.nnodes, str(e)) from None


UNKNOWN = "Unknown"  # Kubeflow SDK's word for what a runtime or a launcher does not say


@dataclass(frozen=True)
class RuntimeTrainer:
    """A runtime's trainer as Kubeflow's SDK describes it: `framework` (the `trainer.kubeflow.org/framework`
    label), the `image` it runs on a launcher ("local": this machine's Python), nodes, device and count."""

    framework: str
    image: str
    num_nodes: int = 1
    device: str = UNKNOWN
    device_count: str = UNKNOWN


@dataclass(frozen=True)
class RuntimeInfo:
    """A runtime as the Client describes it (Kubeflow SDK's `Runtime`: `name`, Kubeflow's ClusterTrainingRuntime of
    that name); `function_only`: it runs a user's function only (Client.train(func=...)), not `python -m trainer`."""

    name: str
    trainer: RuntimeTrainer
    kind: str = "ClusterTrainingRuntime"
    function_only: bool = False


@dataclass(frozen=True)
class RunFacts:
    """What a runtime's rules read of a run beyond its own keys and the launcher's offers (`Runtime.check_run`):
    its node counts (every count of an elastic range), processes per node, the GPUs on this machine that its
    ranks take (0: not counted here), the strategy (`strategy.name`, `strategy.data_parallel`), whether it saves
    checkpoints asynchronously and from how many threads, whether its data cache is Kubeflow's, and the launcher's
    name."""

    counts: range
    per_node: int
    gpus: int
    strategy: str
    data_parallel: str
    checkpoint_async: bool
    checkpoint_threads: int
    kubeflow_cache: bool
    launcher: str


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
    runs, such as `-m <worker> <config>`) run by `python`; `worker`, where the command runs the trainer's worker,
    that module (its agent passes the rank's exit code on; None: a user's script), `nproc_per_node` processes on each of
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
    worker: str | None = None

    @property
    def trainer_run(self) -> bool:
        return self.worker is not None and self.command[:2] == ["-m", self.worker]


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
    # The variables its agent sets that name a rank's place, by torch.distributed's names ({}: those names).
    rank_names: ClassVar[Mapping[str, str]] = {}
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

    def check_run(self, options: Any, run: RunFacts, offers: Offers) -> None:
        """The rules on the rest of the run `run` under a launcher that `offers`: the strategies it runs, what
        this machine lacks to start it, restarts, an elastic range, the GPUs a rank takes; raises OptionError."""
        allowed = self.strategies
        require(allowed is None or run.data_parallel in allowed, "strategy", run.strategy, f"runtime={self.name} "
                f"runs strategy.data_parallel={' or '.join(allowed or ())} only: add strategy={(allowed or ('',))[0]}")
        if offers.runs_here:  # what the runtime's agent needs on this machine (mpirun, ...)
            missing = self.missing()
            require(missing is None, "runtime", self.name, missing or "")
        restarts = getattr(options, "max_restarts", 0)
        require(restarts == 0 or not offers.kubeflow_cache or not run.kubeflow_cache,
                "runtime.max_restarts", restarts, "data.cache.backend=kubeflow runs on the cluster's cache "
                "runtime, which carries no failure policy of trainjob's (restarts would be its own, not the JobSet's "
                "that runtime.max_restarts sets elsewhere): give 0, or data.cache.backend=trainjob")
        require(len(run.counts) == 1 or offers.elastic, "runtime.nnodes", options.nnodes,
                f"an elastic range runs on launcher=local or docker: launcher={run.launcher} runs a fixed number of "
                "nodes (a Kubeflow TrainJob's numNodes: Trainer v2 has no elastic policy); give a node count, and "
                "runtime.max_restarts to restart")
        require(run.gpus == 0 or run.per_node <= run.gpus, "runtime.nproc_per_node", run.per_node,
                f"must be <= {run.gpus}, the GPUs on this machine (each rank takes one)")

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

    def store_command(self, python: str, endpoint: str, run_dir: str | None = None) -> list[str] | None:
        """The command that hosts the job's rendezvous store at `endpoint` apart from its nodes (an elastic job's,
        or one whose nodes start one by one), ending once no node of `run_dir` is left (None: when stopped); None
        for a runtime whose ranks meet without one."""
        return None

    def ssh_hosts(self) -> Any:
        """How a launcher lays out the SSH hosts of a job whose ranks one launcher starts over SSH
        (`hosts_over_ssh`: MPI's `mpi.hosts.SSHHosts`); None for a runtime whose nodes start their own ranks."""
        return None

    def describe(self, image: str, device: str, device_count: str) -> RuntimeInfo:
        """The runtime as the Client describes it, running `image` on `device_count` devices of kind `device`."""
        return RuntimeInfo(self.name, RuntimeTrainer(self.framework, image, 1, device, device_count),
                           function_only=self.function_only)

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
