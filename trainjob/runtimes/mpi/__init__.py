"""`runtime=mpi`: OpenMPI's `mpirun` starts every rank of the job from one launcher (Kubeflow Trainer's MPI
plugin, `mlPolicy.mpi`; the `deepspeed-distributed` runtime is its best-known user). On one machine mpirun
forks the ranks itself; across nodes it reaches them over SSH (port 2222, a hostfile with `slots=<processes
per node>` per host, as Kubeflow writes it). Each rank reads OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and
OMPI_COMM_WORLD_LOCAL_RANK and joins torch.distributed at MASTER_ADDR:MASTER_PORT, which the launcher sets.

MPI jobs are fixed-size: no elastic range, no restarts (a failed rank ends the job with its exit code; the
same command resumes from the newest checkpoint).

Everything of MPI is in this folder: the unit (here), the layout of its SSH hosts for a launcher that lays them
out itself (`hosts.SSHHosts`, what `ssh_hosts()` answers: Docker asks it; on Kubernetes Kubeflow's plugin lays them
out), shared by every runtime whose ranks mpirun starts (`hosts_over_ssh`)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from trainjob.nodes import LOCALHOST, free_port
from trainjob.options import require
from trainjob.runtimes.base import KUBEFLOW_PORT, Nodes, Offers, Runtime, check_counts
from trainjob.runtimes.mpi.hosts import (
    HOSTFILE_ENV,
    KUBEFLOW_HOSTFILE,
    SSH_HOSTS,
    SSH_PORT,
    SSHHosts,
    on_each_host,
    rank0_host,
)

INSTALL = "apt-get install -y openmpi-bin"
# ssh to a node's sshd (Kubeflow's MPI runtimes listen on 2222), whose host key is the job's own.
RSH_ARGS = f"-p {SSH_PORT} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectionAttempts=10"
# What the ranks read, from OpenMPI's environment, as torch.distributed's names (`Runtime.rank_names`).
CONTRACT = {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
            "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE"}
# mpirun refuses to run as root unless told; containers and CI run as root.
AGENT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@dataclass
class MPIConfig:
    name: str = "mpi"  # the runtime chosen (mpi: OpenMPI's mpirun starts the ranks)
    # null: the GPU count on this machine, or 2 without GPUs (Kubeflow's numProcPerNode: the hostfile's slots).
    nproc_per_node: int | None = None
    # A node count: MPI jobs are fixed-size.
    nnodes: Any = 1
    # Kubeflow's mlPolicy.mpi: OpenMPI is the one implementation its MPI plugin supports.
    mpi_implementation: str = "OpenMPI"
    # Where every node's SSH key pair is mounted (mlPolicy.mpi.sshAuthMountPath); Docker mounts the job's pair there
    # too (where it is a `.ssh` directory, its parent is the containers' HOME).
    ssh_auth_mount_path: str = "/root/.ssh"
    # The launcher is an MPI host too, node 0 (mlPolicy.mpi.runLauncherAsNode).
    run_launcher_as_node: bool = True
    # The rendezvous port of rank 0's host; null: a free port on one machine, 29500 across nodes.
    master_port: int | None = None

    POSITIVE: ClassVar[tuple[str, ...]] = ()


class MPI(Runtime):
    name = "mpi"
    schema = MPIConfig
    runtime_ref = "deepspeed-distributed"  # the ClusterTrainingRuntime Kubeflow ships with mlPolicy.mpi
    framework = "mpi"
    hosts_over_ssh = True
    function_jobs = True
    rank_names = CONTRACT
    kubeflow_image = "ghcr.io/kubeflow/trainer/deepspeed-runtime"

    def check(self, options: MPIConfig) -> None:
        require(":" not in str(options.nnodes), "runtime.nnodes", options.nnodes,
                f"runtime={self.name} jobs are fixed-size (mpirun starts a fixed set of ranks): give a node count N")
        path = str(options.ssh_auth_mount_path)
        require(path.startswith("/") and path.rstrip("/") != "" and not any(c in path for c in ": \t\n"),
                "runtime.ssh_auth_mount_path", options.ssh_auth_mount_path,
                "must be an absolute directory path below / without ':' or spaces, such as /root/.ssh")
        check_counts(options)
        require(options.mpi_implementation == "OpenMPI", "runtime.mpi_implementation", options.mpi_implementation,
                "must be OpenMPI (the one implementation Kubeflow Trainer's MPI plugin supports)")
        require(options.master_port is None or 0 < options.master_port < 65536, "runtime.master_port",
                options.master_port, "must be a TCP port in [1, 65535], or null")

    def check_job(self, options: MPIConfig, counts: range, offers: Offers) -> None:
        # On this machine mpirun forks one node's ranks; more nodes, or nodes elsewhere, need a launcher that lays
        # out MPI's launcher and SSH hosts (Kubeflow's MPI plugin).
        over_ssh = f"runtime={self.name} starts every node's ranks from one launcher over SSH"
        if offers.runs_here:
            require(counts[-1] == 1 or offers.ssh_hosts, "runtime.nnodes", options.nnodes,
                    f"{over_ssh}: on this machine it runs one node; several nodes run with launcher=docker or "
                    "launcher=kubernetes")
        require(offers.runs_here or offers.ssh_hosts, "runtime", self.name,
                f"{over_ssh}, which this launcher does not lay out: run it on this machine (launcher=local), with "
                "launcher=docker or with launcher=kubernetes")

    def missing(self) -> str | None:
        if shutil.which("mpirun"):
            return None
        return (f"runtime={self.name} needs OpenMPI's mpirun, which is not on PATH: install the Debian package "
                f"openmpi-bin ({INSTALL}, as root)")

    def node_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        # Across hosts mpirun reads the hostfile and ssh's options from its container's environment (`launcher_env`,
        # as Kubeflow's plugin sets it) and the hosts' ssh client configuration (`ssh_config`).
        across = bool(nodes.hosts)
        cmd = ["mpirun", "-np", str(nodes.nnodes * nodes.nproc_per_node), "--bind-to", "none"]
        if not across:
            cmd += ["--oversubscribe"]  # one machine: its slots are its cores, which the ranks share
        master = nodes.hosts[0] if across else LOCALHOST
        port = options.get("master_port") or (KUBEFLOW_PORT if across else free_port())
        return [*cmd, *_exports(nodes, {"MASTER_ADDR": master, "MASTER_PORT": str(port)}), nodes.python,
                *nodes.command]

    def kubeflow_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        # Kubeflow's MPI plugin mounts the hostfile (OMPI_MCA_orte_default_hostfile) and sets the slots; the ranks
        # meet at its first host (`rank_env`), on the runtime's master_port.
        port = str(options.get("master_port") or KUBEFLOW_PORT)
        return ["mpirun", "--bind-to", "none", "--mca", "plm_rsh_args", RSH_ARGS,
                *_exports(nodes, {"MASTER_PORT": port}), nodes.python, *nodes.command]

    def agent_env(self, options: Mapping[str, Any]) -> dict[str, str]:
        return dict(AGENT_ENV)

    def ssh_hosts(self) -> SSHHosts:
        return SSH_HOSTS

    def install_command(self, packages: list[str], python: str) -> list[str]:
        # Once on each host of the hostfile, not once per rank (nor on the launcher alone).
        return on_each_host(super().install_command(packages, python), hostfile=KUBEFLOW_HOSTFILE)

    def rank_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        if CONTRACT["RANK"] not in environ:
            return {}
        env = {name: environ[ompi] for name, ompi in CONTRACT.items() if ompi in environ}
        if "MASTER_ADDR" not in environ:  # under Kubeflow: rank 0's host, from the hostfile its plugin wrote
            env["MASTER_ADDR"] = rank0_host(environ.get(HOSTFILE_ENV, KUBEFLOW_HOSTFILE))
        env.setdefault("MASTER_PORT", environ.get("MASTER_PORT", str(KUBEFLOW_PORT)))
        return env

    def ml_policy(self, options: Mapping[str, Any], nnodes: int, nproc_per_node: int) -> dict[str, Any]:
        return {"numNodes": nnodes, "mpi": {
            "numProcPerNode": nproc_per_node, "mpiImplementation": options["mpi_implementation"],
            "sshAuthMountPath": options["ssh_auth_mount_path"], "runLauncherAsNode": options["run_launcher_as_node"]}}


def _exports(nodes: Nodes, values: dict[str, str]) -> list[str]:
    """mpirun's -x options: `values`, torchrun's one thread a rank where a node runs several (a rank's own
    threads would otherwise oversubscribe the cores), and the agent's variables the ranks need (remote ranks do
    not inherit its environment)."""
    if nodes.nproc_per_node > 1 and "OMP_NUM_THREADS" not in nodes.env_names:
        values = {**values, "OMP_NUM_THREADS": "1"}
    return [arg for key, value in values.items() for arg in ("-x", f"{key}={value}")] + [
        arg for key in nodes.env_names for arg in ("-x", key)]


RUNTIME = MPI()
