"""The SSH hosts of a job whose ranks mpirun starts from one launcher (`Runtime.hosts_over_ssh`: runtime=mpi,
deepspeed-distributed, mlx-distributed), as Kubeflow Trainer's MPI plugin lays out its pods: `SSHHosts`, which a
launcher that lays them out itself (Docker; on Kubernetes the plugin does) asks the runtime for
(`Runtime.ssh_hosts()`), so that it names no runtime's module.

It says how many node hosts start beside the launcher and in which order the hostfile lists them (`node_hosts`,
`hosts`), which hosts run the ranks (`placement`, rank 0's first), the files every host reads (`hostfile`,
`sshd_config`, `ssh_config`), each node host's command (`sshd_command`: sshd on port 2222, its host key the job's
own key, as Kubeflow's images run it), the launcher's OMPI_MCA_* settings (`launcher_env`), how the job's key pair is
made (`KEYGEN`) and a command run once on each host (`on_each_host`)."""

from __future__ import annotations

# Kubeflow's MPI sshd port.
SSH_PORT = 2222
# Where Kubeflow's MPI plugin mounts the hostfile, and the variable that names it.
KUBEFLOW_HOSTFILE = "/etc/mpi/hostfile"
HOSTFILE_ENV = "OMPI_MCA_orte_default_hostfile"
# The job's key pair in a directory of its own, named as Kubeflow's plugin mounts its Secret (id_rsa: the private
# key, also every sshd's host key; id_rsa.pub and authorized_keys: the public key). Run with that directory as $1
# and the key's comment (the job's name) as $2.
KEYGEN = ('ssh-keygen -q -t ecdsa -b 521 -N "" -C "$2" -f "$1/id_rsa" && cp "$1/id_rsa.pub" "$1/authorized_keys" '
          '&& chmod 0600 "$1/id_rsa"')


def on_each_host(command: list[str], env_names: tuple[str, ...] = (), hostfile: str | None = None) -> list[str]:
    """mpirun running `command` once on each host of the hostfile (`hostfile`, or the one its environment names), with
    `env_names` passed on: a job's packages_to_install, installed once per node, not once per rank."""
    return ["mpirun", *(["--hostfile", hostfile] if hostfile else []), "--map-by", "ppr:1:node",
            *(arg for key in env_names for arg in ("-x", key)), *command]


def placement(hosts: list[str], launcher: str) -> list[str]:
    """The hostfile's `hosts` in the order mpirun fills their slots: its own host (the launcher) first where it is
    one (OpenMPI's daemon 0, whichever line of the hostfile names it), then the others as listed; so rank 0, whose
    host the ranks meet at, runs on the launcher where it is a host."""
    return [*(h for h in hosts if h == launcher), *(h for h in hosts if h != launcher)]


def launcher_env(slots: int) -> dict[str, str]:
    """What Kubeflow's MPI plugin sets on the launcher's container for OpenMPI (RUNTIMES.md §1), which mpirun reads:
    the hostfile, host names kept whole, `slots` per host, and ssh's options."""
    return {HOSTFILE_ENV: KUBEFLOW_HOSTFILE, "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
            "OMPI_MCA_orte_set_default_slots": str(slots), "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}


def rank0_host(path: str) -> str:
    """The host rank 0 runs on under Kubeflow's MPI plugin, from its hostfile at `path`: the launcher pod
    (`<job>-launcher-0-0.<job>`, where mpirun runs: `placement`) when the hostfile names it (runLauncherAsNode),
    else the first host."""
    with open(path) as f:
        listed = [line.split()[0] for line in f if line.strip() and not line.lstrip().startswith("#")]
    launcher = next((h for h in listed if h.split(".")[0].endswith("-launcher-0-0")), None)
    return placement(listed, launcher)[0]


class SSHHosts:
    """How a launcher lays out the SSH hosts of an MPI job (the module's docstring): what `Runtime.ssh_hosts()`
    answers for a runtime whose ranks mpirun starts over SSH."""

    hostfile_path = KUBEFLOW_HOSTFILE
    keygen = KEYGEN
    placement = staticmethod(placement)
    launcher_env = staticmethod(launcher_env)
    on_each_host = staticmethod(on_each_host)

    @staticmethod
    def node_hosts(nnodes: int, run_launcher_as_node: bool) -> int:
        """How many node hosts Kubeflow's MPI plugin starts beside the launcher for a job of `nnodes` nodes: one
        fewer where the launcher is a host too (runLauncherAsNode), and at least one."""
        return max(nnodes - 1, 1) if run_launcher_as_node else nnodes

    @staticmethod
    def hosts(nodes: list[str], launcher: str, run_launcher_as_node: bool) -> list[str]:
        """The hostfile's hosts in Kubeflow's order: the nodes, then the launcher where it is a host (its
        deepspeed and mlx runtimes list `node` before `launcher`), so that rank 0 runs on the first node."""
        return [*nodes, *([launcher] if run_launcher_as_node else [])]

    @staticmethod
    def hostfile(hosts: list[str], slots: int) -> str:
        """An OpenMPI hostfile as Kubeflow writes it: one `<host> slots=<processes per node>` line per host."""
        return "".join(f"{h} slots={slots}\n" for h in hosts)

    @staticmethod
    def sshd_config(ssh_dir: str, pid_file: str) -> str:
        """The sshd configuration of every host of a job whose keys are in `ssh_dir` (Kubeflow's images: the job's
        private key is the host key, port 2222, no strict modes); it runs as the user the ranks run as."""
        return (f"Port {SSH_PORT}\nHostKey {ssh_dir}/id_rsa\nAuthorizedKeysFile {ssh_dir}/authorized_keys\n"
                f"PidFile {pid_file}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n")

    @staticmethod
    def ssh_config(ssh_dir: str) -> str:
        """The ssh client's configuration of every host of a job whose keys are in `ssh_dir` (/etc/ssh/ssh_config,
        as Kubeflow's MPI images hold it): sshd's port 2222, no host key checked (every sshd's is the job's own key),
        and the job's private key, wherever it is mounted."""
        return (f"Host *\n    Port {SSH_PORT}\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n"
                f"    IdentityFile {ssh_dir}/id_rsa\n")

    @staticmethod
    def sshd_command(ssh_dir: str) -> list[str]:
        """A node host's command: sshd in the foreground, logging to stderr, as Kubeflow's node pods run it."""
        return ["/usr/sbin/sshd", "-D", "-e", "-f", f"{ssh_dir}/sshd_config"]


SSH_HOSTS = SSHHosts()
