"""The SSH hosts of a job on Docker whose runtime starts every node's ranks from one launcher over SSH
(`hosts_over_ssh`: runtime=mpi), laid out as Kubeflow's MPI plugin lays out its pods: node containers
`<job>-node-<i>` running sshd on port 2222, and a launcher container `<job>-launcher` running mpirun over the
hostfile it mounts at /etc/mpi/hostfile (`<host> slots=<processes per node>`), itself a host where
runtime.run_launcher_as_node (the runtime's `ssh_hosts()` says how many nodes, in which order, and how sshd runs).

The job's key pair is made at launch by a container of the job's own image (its ssh-keygen), in a directory of
this host that only the invoking user reads (`key_dir`: `<tmp>/trainjob-ssh-<uid>/<job>`, 0700), mounted read-only
in every container at runtime.ssh_auth_mount_path (Kubeflow's sshAuthMountPath), where sshd and ssh (its
/etc/ssh/ssh_config, mounted too) find it: never in the image, never another job's (a relaunch makes a new pair),
and removed with the job's containers. The containers run as the invoking user, whom the image need not know while
ssh and sshd do: the same container writes the image's /etc/passwd with that user's entry (home: the containers' HOME),
which the job's containers mount over their own.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Any

from launchers.base import LauncherError
from trainjob.runtimes import Runtime

# The exit code of the key container (or of a job's check container) where the image lacks what the job's containers
# run: OpenMPI, sshd, or the runtime's modules and libraries (its one line says which).
NO_MPI = 3
# Run as root by a container of the image with the key directory at /ssh: what an MPI host needs is there (and what
# the runtime's ranks import and load: $8, $9), the image's passwd with the invoking user's entry, the key pair, all of
# it the user's.
_CHECK = ("import ctypes, importlib.util as u, sys\n"
          "lacking = [m for m in sys.argv[1].split() if u.find_spec(m) is None]\n"
          "for lib in sys.argv[2].split():\n"
          "    try:\n        ctypes.CDLL(lib)\n    except OSError:\n        lacking.append(lib)\n"
          "sys.exit(' and '.join(lacking) if lacking else 0)")
# What the ranks of runtime $7 import ($8) and load ($9), found in image $6, or one line naming what it lacks and how
# to build it (${10}).
_FRAMEWORK = (f'if ! lacking=$(python -c "{_CHECK}" "$8" "$9" 2>&1); then '
              'echo "launcher.image=$6 holds no $lacking, which runtime=$7 runs in every container: build it with '
              f'${{10}}" >&2; exit {NO_MPI}; fi; ')
_KEYS = (
    'if ! command -v mpirun >/dev/null || [ ! -x /usr/sbin/sshd ] || ! command -v ssh-keygen >/dev/null; then '
    'echo "launcher.image=$6 holds no OpenMPI or no sshd, which runtime=$7 runs in every container: build it with '
    f'docker build --build-arg MPI=1" >&2; exit {NO_MPI}; fi; {_FRAMEWORK}'
    'grep -v "^[^:]*:[^:]*:$3:" /etc/passwd >/ssh/passwd; echo "$2:x:$3:$4::$5:/bin/sh" >>/ssh/passwd; '
    'set -- /ssh "$1"; {keygen}; chown "$(stat -c %u:%g /ssh)" /ssh/*')


@dataclass(frozen=True)
class Layout:
    """The containers of an MPI job: `nodes` (sshd), the `launcher` (mpirun), and the hostfile's `hosts`; every
    container's `ssh_dir`, where the job's keys are mounted, and its `home`; `ssh`: how the runtime lays out its SSH
    hosts (`Runtime.ssh_hosts()`)."""

    nodes: list[str]
    launcher: str
    hosts: list[str]
    ssh_dir: str
    home: str
    ssh: Any


def layout(name: str, runtime: Runtime, nnodes: int, run_launcher_as_node: bool, ssh_dir: str, home: str) -> Layout:
    """Job `name`'s containers under `runtime`, its keys mounted at `ssh_dir` (runtime.ssh_auth_mount_path): where
    that is a `.ssh` directory, its parent is the containers' HOME (as the user's home holds it in Kubeflow's images:
    /root, /home/mpiuser), else `home`."""
    hosts = runtime.ssh_hosts()
    nodes = [f"{name}-node-{i}" for i in range(hosts.node_hosts(nnodes, run_launcher_as_node))]
    launcher = f"{name}-launcher"
    ssh_dir = ssh_dir.rstrip("/")
    home = os.path.dirname(ssh_dir) if os.path.basename(ssh_dir) == ".ssh" else home
    return Layout(nodes, launcher, hosts.hosts(nodes, launcher, run_launcher_as_node), ssh_dir, home, hosts)


def key_dir(name: str) -> str:
    """This host's directory of job `name`'s keys."""
    return os.path.join(tempfile.gettempdir(), f"trainjob-ssh-{os.getuid()}", name)


def keys_container(name: str) -> str:
    return f"{name}-ssh-keys"


def _framework_args(image: str, runtime: Runtime) -> list[str]:
    """$6 to ${10} of `_FRAMEWORK`: the image, the runtime, what its ranks import and load, how to build it."""
    build = f"trainjob's {runtime.extra} extra (pip install 'trainjob[{runtime.extra}]')" if runtime.extra else ""
    if "libmpi.so" in runtime.libraries:
        build += f"{' and ' if build else ''}Debian's libopenmpi-dev (its libmpi.so)"
    return [image, runtime.name, " ".join(runtime.imports), " ".join(runtime.libraries), build or "what it imports"]


def keygen_command(name: str, image: str, user: str, home: str, runtime: Runtime) -> list[str]:
    """The `docker run` that makes job `name`'s key pair and passwd in its `key_dir` (made first: `make_key_dir`),
    once it has found in the image what `runtime`'s containers run."""
    keys = _KEYS.replace("{keygen}", runtime.ssh_hosts().keygen)
    return ["docker", "run", "--rm", "--name", keys_container(name), "--network", "none", "--user", "0:0",
            "--volume", f"{key_dir(name)}:/ssh", "--entrypoint", "", image, "sh", "-euc", keys, "sh", name, user,
            str(os.getuid()),
            str(os.getgid()), home, *_framework_args(image, runtime)]


def check_container(name: str) -> str:
    return f"{name}-check"


def check_command(name: str, image: str, runtime: Runtime) -> list[str]:
    """The `docker run` that finds in the image what the ranks of `runtime` (one that starts no SSH host) import and
    load, before job `name`'s containers start: it exits NO_MPI with one line where the image lacks some."""
    return ["docker", "run", "--rm", "--name", check_container(name), "--network", "none", "--entrypoint", "", image,
            "sh", "-euc", _FRAMEWORK, "sh", "", "", "", "", "", *_framework_args(image, runtime)]  # $1-$5: unused


def volumes(name: str, lay: Layout, launcher: bool) -> list[str]:
    """A container's mounts of the job's keys (at the layout's `ssh_dir`), its passwd and ssh client configuration
    and, on the launcher, the hostfile."""
    keys = key_dir(name)
    out = ["--volume", f"{keys}:{lay.ssh_dir}:ro", "--volume", f"{keys}/passwd:/etc/passwd:ro",
           "--volume", f"{keys}/ssh_config:/etc/ssh/ssh_config:ro"]
    return out + (["--volume", f"{keys}/hostfile:{lay.ssh.hostfile_path}:ro"] if launcher else [])


def make_key_dir(name: str, lay: Layout, slots: int) -> None:
    """Job `name`'s key directory, new and empty but for the hostfile and the configuration of sshd and of ssh, which
    find the keys at `ssh_dir` (they come from `keygen_command`); the directory above it is the user's alone, or
    this refuses."""
    top = os.path.dirname(key_dir(name))
    os.makedirs(top, mode=0o700, exist_ok=True)
    st = os.lstat(top)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise LauncherError(f"{top} (where the jobs' SSH keys are made) is not a directory that only this user "
                            "may read: remove it")
    remove_key_dir(name)
    os.mkdir(key_dir(name), 0o700)
    for file, text in (("hostfile", lay.ssh.hostfile(lay.hosts, slots)),
                       ("sshd_config", lay.ssh.sshd_config(lay.ssh_dir, f"{lay.home}/sshd.pid")),
                       ("ssh_config", lay.ssh.ssh_config(lay.ssh_dir))):
        with open(os.path.join(key_dir(name), file), "w") as f:
            f.write(text)


def remove_key_dir(name: str) -> None:
    shutil.rmtree(key_dir(name), ignore_errors=True)
