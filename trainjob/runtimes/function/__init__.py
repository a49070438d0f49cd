"""What the runtimes that run a user's function only have in common (`FunctionRuntime`): Kubeflow Trainer's
`jax-distributed`, `xgboost-distributed` and `mlx-distributed`, whose frameworks are not
the trainer's (`Client.train(func=..., runtime=NAME)`, `python -m launchers train --runtime NAME script.py`).
A `python -m trainer` run on one is refused; the framework not installed here is named with its pip extra; on
Kubernetes the TrainJob names the shipped ClusterTrainingRuntime itself (as Kubeflow's SDK does), whose plugin
sets the environment.

Locally a job's "nodes" are processes on this machine: `ProcessPerNode` starts one per node under its agent
`procs` here (`python -m trainjob.runtimes.function.procs`) with the environment Kubeflow's plugin gives each pod
(JAX, XGBoost), `MPIFunction` starts every rank under `mpirun` with the `OMPI_MCA_*` settings Kubeflow's MPI
plugin sets (MLX). On Docker every node is a container: `ProcessPerNode` runs the node's one process there,
meeting at node 0's container on port 29500; `MPIFunction` runs as runtime=mpi does, from a launcher container over
SSH.
"""

from __future__ import annotations

import importlib.util
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, make_dataclass
from typing import Any, ClassVar

from trainjob.nodes import LOCALHOST, free_port
from trainjob.options import OptionError
from trainjob.runtimes import mpi
from trainjob.runtimes.base import KUBEFLOW_PORT, Nodes, Offers, Runtime
from trainjob.runtimes.mpi import hosts

# The agent beside this module that starts a job's nodes as processes here, run as `python -m`.
PROCS = "trainjob.runtimes.function.procs"


def node_host(job: str) -> str:
    """Node 0's host name in a Kubeflow TrainJob `job` (JobSet's `<job>-node-0-0.<job>`)."""
    return f"{job}-node-0-0.{job}"


@dataclass
class FunctionOnlyConfig:
    """The keys of a function-only runtime: its name alone. Each runtime's schema extends it with its name as the
    default (`FunctionRuntime.__init_subclass__`)."""

    name: str = ""  # a function-only runtime (Client.train(func=..., runtime=...))


class FunctionRuntime(Runtime):
    """A runtime that runs a user's function only. A subclass's name is Kubeflow's (`<framework>-distributed`), and
    the framework names the rest it does not declare: its pip extra, the module its ranks import. Its keys are its
    name alone (Client.train(func=..., runtime=...) takes the rest)."""

    function_jobs = True
    function_only = True
    derives_runtime = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            title = "".join(part.capitalize() for part in cls.name.split("-"))
            cls.schema = make_dataclass(f"{title}Config", [("name", str, field(default=cls.name))],
                                        bases=(FunctionOnlyConfig,))
            cls.schema.__module__ = cls.__module__
            framework = cls.name.removesuffix("-distributed")
            derived = {"runtime_ref": cls.name, "framework": framework, "extra": framework, "imports": (framework,)}
            for attribute, value in derived.items():  # what the subclass declares itself stays
                if attribute not in cls.__dict__:
                    setattr(cls, attribute, value)

    def check(self, options: Any) -> None:
        raise OptionError("runtime", self.name, f"runs a user's function, not a trainer run: "
                          f"Client.train(func=..., runtime={self.name!r}) or python -m launchers train "
                          f"--runtime {self.name} script.py")

    def check_job(self, options: Any, counts: range, offers: Offers) -> None:
        self.check(options)

    def missing(self) -> str | None:
        absent = [m for m in self.imports if importlib.util.find_spec(m) is None]
        if not absent:
            return None
        return (f"runtime={self.name} needs {', '.join(absent)}, which is not installed here: "
                f"pip install 'trainjob[{self.extra}]'")

    def kubeflow_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        # The SDK's DEFAULT_COMMAND's entrypoint: python runs the function's file on every node.
        return [nodes.python, *nodes.command]

    def plugin_env(self, job: str, nnodes: int, gpus_per_node: int = 0) -> dict[str, str]:
        """The environment Kubeflow's plugin gives node 0's container of TrainJob `job` (the index is each
        pod's own: its Job completion index)."""
        return {}


class ProcessPerNode(FunctionRuntime):
    """One process per node, which the framework joins at node 0's coordinator (JAX, XGBoost)."""

    index_env: ClassVar[str]  # the variable that holds the node's index (the pod's Job completion index)

    @abstractmethod
    def node_env(self, host: str, port: int, nnodes: int, workers_per_node: int = 1) -> dict[str, str]:
        """Every node's environment but its index, with the coordinator at host:port (its plugin's variables)."""

    def node_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        if nodes.node is not None:  # this node alone on a host of its own: node 0's on Kubeflow's port, as upstream
            env = {**self.node_env(nodes.endpoint.rsplit(":", 1)[0], KUBEFLOW_PORT, nodes.nnodes),
                   self.index_env: str(nodes.node)}
            return ["env", *(f"{k}={v}" for k, v in env.items()), nodes.python, *nodes.command]
        host, port = (nodes.endpoint.rsplit(":", 1) if nodes.endpoint else (LOCALHOST, free_port()))
        env = self.node_env(host, int(port), nodes.nnodes)
        return [nodes.python, "-m", PROCS, "--count", str(nodes.nnodes), "--index", self.index_env,
                *(a for k, v in env.items() for a in ("--env", f"{k}={v}")), "--", nodes.python, *nodes.command]

    def plugin_env(self, job: str, nnodes: int, gpus_per_node: int = 0) -> dict[str, str]:
        return {**self.node_env(node_host(job), KUBEFLOW_PORT, nnodes, gpus_per_node or 1), self.index_env: "0"}


class MPIFunction(FunctionRuntime):
    """Every rank started by `mpirun` from one launcher (MLX: Kubeflow's MPI plugin, `mlPolicy.mpi`).
    Locally mpirun forks `nodes x processes per node` ranks on this machine, with the `OMPI_MCA_*` settings the
    plugin gives its launcher; on a cluster `mpirun --hostfile /etc/mpi/hostfile` (the SDK's MPI_COMMAND)."""

    hosts_over_ssh = True
    rank_names = mpi.CONTRACT

    def missing(self) -> str | None:
        return mpi.RUNTIME.missing() or super().missing()

    def node_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        if nodes.hosts:  # across hosts (Docker): as runtime=mpi reaches them, over SSH with the job's hostfile
            return mpi.RUNTIME.node_command(options, nodes)
        ranks = nodes.nnodes * nodes.nproc_per_node
        env = {k: v for k, v in hosts.launcher_env(ranks).items() if k != hosts.HOSTFILE_ENV}  # one host: no hostfile
        return ["env", *(f"{k}={v}" for k, v in env.items()), "mpirun", "-np", str(ranks), "--bind-to", "none",
                "--oversubscribe", nodes.python, *nodes.command]

    def kubeflow_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        return ["mpirun", "--hostfile", hosts.KUBEFLOW_HOSTFILE, nodes.python, *nodes.command]

    def install_command(self, packages: list[str], python: str) -> list[str]:
        return mpi.RUNTIME.install_command(packages, python)

    def agent_env(self, options: Mapping[str, Any]) -> dict[str, str]:
        return dict(mpi.AGENT_ENV)

    def ssh_hosts(self) -> hosts.SSHHosts:
        return hosts.SSH_HOSTS

    def ml_policy(self, options: Mapping[str, Any], nnodes: int, nproc_per_node: int) -> dict[str, Any]:
        return {"numNodes": nnodes, "mpi": {"numProcPerNode": nproc_per_node}}

    def plugin_env(self, job: str, nnodes: int, gpus_per_node: int = 0) -> dict[str, str]:
        return hosts.launcher_env(max(1, gpus_per_node))

