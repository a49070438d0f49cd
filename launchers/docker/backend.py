"""The Docker launcher: one container per node on one user-defined network of this host.

Node `i` is container `<job>-node-<i>`; torchrun on every node meets at a c10d rendezvous on node 0,
reached by its container name on the job's network. The run directory and the data cache are mounted
at the same paths as on this host, so the resolved config and the worker command are the launcher's
usual ones. Data cache nodes (`data.cache.nodes`) run as containers `<job>-cache-<i>` of the same image
on the network, and the ranks start once each answers `python -m datacache ready`. Node `i` gets GPUs
`i*g .. i*g+g-1` of the host (`launcher.gpus_per_node=g`) and, as every node shares this host, CPUs
`i*c .. i*c+c-1` of those this process may use (`--cpuset-cpus`; `launcher.cpus_per_node=c`, by default
an equal share), with OMP_NUM_THREADS set to its ranks' share of them. The containers run as the user
who launched them (`--user uid:gid`, HOME a private tmpfs), so that the run directory and the data cache
stay theirs. Secrets reach the containers as environment
variables named on the command line and valued from the docker CLI's own environment, so no value shows
in `ps` or in the printed commands. A relaunch of the same run
directory first removes the last attempt's stopped containers and network; a launch that fails half way
removes what it started; containers are removed once the job has finished (the logs are in the run
directory). It drives the `docker` CLI; `launcher.dry_run=true` prints the commands instead.

A runtime that starts every node's ranks from one launcher over SSH (runtime=mpi) runs as Kubeflow lays it out
(`launchers.docker.ssh`): sshd in the node containers, mpirun in `<job>-launcher`, the job's own key pair made at
launch and removed with it; the job ends as its launcher does, or fails as soon as a node's container stops.

A function job's packages_to_install go into an environment of each node container's own in its HOME
(`launchers.packages`), made before its ranks start (under MPI: once on each host, by mpirun from the launcher).
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from launchers import packages
from launchers.backend import Backend, runtime_unit
from launchers.base import (
    Job,
    JobInfo,
    JobState,
    LauncherError,
    LaunchSpec,
    PollingJob,
    Step,
    check_step,
    node_command,
    run_name,
)
from launchers.docker import credentials, ssh
from launchers.docker.options import image_ok
from trainjob.run_files import read_progress
from trainjob.runtimes import UNKNOWN, Runtime

RDZV_PORT = 29400
HOME = "/home/trainjob"  # each container's HOME
RUN_LABEL, ROLE_LABEL, DIR_LABEL = "trainjob.run", "trainjob.role", "trainjob.run_dir"


def job_name(spec: LaunchSpec) -> str:
    return run_name(spec.run_dir, max_len=49)


def _check_spec(spec: LaunchSpec, image: str) -> None:
    """What Docker would misread: an image that looks like a flag, a run directory with ':' (the volume
    separator)."""
    if not image_ok(image):
        raise LauncherError(
            f"launcher.image={image!r}: give an image reference such as 'trainjob:latest' "
            "(not empty, no leading '-', no spaces)"
        )
    for path in (spec.run_dir, spec.cache_dir or ""):
        if ":" in path:
            raise LauncherError(
                f"{path!r} holds ':', which docker reads as a volume separator: choose a run "
                "directory (hydra.run.dir) and data.cache_dir without ':'"
            )


def gpu_devices(node: int, per_node: int) -> str:
    """The `--gpus` value that gives node `node` its own GPUs (docker's CSV form needs the quotes)."""
    return '"device=' + ",".join(str(node * per_node + i) for i in range(per_node)) + '"'


def host_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity), which the nodes share out."""
    return sorted(os.sched_getaffinity(0))


def cpu_shares(nnodes: int, per_node: int | None, cpus: list[int]) -> list[list[int]]:
    """Each node's own CPUs: `per_node` of `cpus` (None: an equal share, at least one), consecutive; where
    the nodes ask for more than there are, the shares wrap around (launch refuses that)."""
    per_node = per_node or max(1, len(cpus) // nnodes)
    return [[cpus[(node * per_node + i) % len(cpus)] for i in range(per_node)] for node in range(nnodes)]


def _user(home: str) -> tuple[str, dict[str, str], list[str]]:
    """`--user`, the environment and the options that make a container run as the invoking user, with a
    HOME of its own at `home` that it can write (a tmpfs: the image has no home for an arbitrary uid)."""
    uid, gid = os.getuid(), os.getgid()
    try:
        user = getpass.getuser()  # torch and triton name their caches after it; the image has no passwd entry
    except (KeyError, OSError):
        user = f"uid{uid}"
    opts = ["--tmpfs", f"{home}:uid={uid},gid={gid},mode=0700"]
    return f"{uid}:{gid}", {"HOME": home, "USER": user}, opts


def host_gpus() -> int | None:
    """How many GPUs this host has, when nvidia-smi can tell."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else None


def _time(text: str) -> datetime | None:
    """Docker's RFC 3339 time (nanoseconds and all); None for its zero time or nothing."""
    if not text or text.startswith("0001-"):
        return None
    return datetime.fromisoformat(text[:19] + "+00:00")


def _device(limits: list[str]) -> tuple[str, str]:
    """A container's device and count from its `cpus=<cpuset>` and `gpus=<ids>` (`_inspect`), as Kubeflow's SDK reads
    a pod's from its limits: its GPUs, else its CPUs; Unknown where it has neither of its own (an MPI launcher that
    runs no rank)."""
    found = dict(f.split("=", 1) for f in limits if "=" in f)
    if found.get("gpus"):
        return "gpu", str(len(found["gpus"].split(",")))
    if found.get("cpus"):
        ranges = [r.split("-") for r in found["cpus"].split(",")]
        return "cpu", str(sum(int(r[-1]) - int(r[0]) + 1 for r in ranges))
    return UNKNOWN, UNKNOWN


def _state(status: str, code: str) -> JobState:
    if status == "missing" or (status == "exited" and code != "0"):
        return JobState.FAILED
    if status == "exited":
        return JobState.COMPLETE
    return JobState.RUNNING if status in ("running", "restarting", "paused") else JobState.CREATED


def _docker(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            ["docker", *args], capture_output=True, text=True, env={**os.environ, **env} if env else None
        )
    except FileNotFoundError:
        raise LauncherError("launcher=docker needs the docker CLI on PATH") from None
    if check and proc.returncode != 0:
        raise LauncherError(f"docker {' '.join(args[:2])} failed: {_reason(proc.stderr)}")
    return proc


def _reason(stderr: str) -> str:
    """Docker's error on one line, without its pointer to `--help`."""
    return " ".join(line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("See '"))


def _remove(name: str, containers: list[str], own_network: bool) -> None:
    """Remove `containers`, and the job's own network once nothing uses it, and its SSH keys where it has any."""
    if containers:
        _docker("rm", "--force", *containers, check=False)
    if own_network:
        _docker("network", "rm", name, check=False)
    ssh.remove_key_dir(name)


def _containers(name: str | None = None) -> list[dict[str, str]]:
    """Every container a trainjob run left (of run `name` only, when given): name, state and labels."""
    fields = ["{{.Names}}", "{{.State}}", *(f'{{{{.Label "{k}"}}}}' for k in (RUN_LABEL, ROLE_LABEL, DIR_LABEL))]
    out = _docker(
        "ps", "--all", "--filter", f"label={RUN_LABEL}" + (f"={name}" if name else ""), "--format", "\t".join(fields)
    )
    keys = ("name", "state", "run", "role", "run_dir")
    return [dict(zip(keys, line.split("\t"), strict=False)) for line in out.stdout.splitlines() if line.strip()]


class DockerJob(PollingJob):
    """The containers of run `name`: nodes `<name>-node-<i>`, cache nodes `<name>-cache-<i>`, an elastic
    run's rendezvous store `<name>-rdzv`, an MPI run's launcher `<name>-launcher` (`mpi_launcher`: its
    nodes run sshd, and the job is the launcher's), on the job's own network unless `own_network` is false."""

    def __init__(self, name: str, run_dir: str | None, nnodes: int, own_network: bool, caches: list[str],
                 elastic: bool = False, mpi_launcher: bool = False):
        self.name, self.run_dir, self.nnodes, self._own_network = name, run_dir, nnodes, own_network
        self._caches = list(caches) + ([f"{name}-rdzv"] if elastic else [])
        self.elastic, self.mpi_launcher = elastic, mpi_launcher
        self._cancelled = False
        self._final: JobState | None = None
        self.exit_code: int | None = None
        self.failure: str | None = None

    def _container(self, node: int) -> str:
        return f"{self.name}-node-{node}"

    def _names(self) -> list[str]:
        """The containers whose states make the job's: the nodes, then an MPI run's launcher."""
        return [self._container(n) for n in range(self.nnodes)] + ([f"{self.name}-launcher"] if self.mpi_launcher
                                                                  else [])

    def _cleanup(self) -> None:
        _remove(self.name, self._names() + self._caches, self._own_network)

    def wait(self, timeout: float | None = None) -> JobState:
        state = super().wait(timeout)
        if state.finished and self._final is None:
            self._final = state
            self._cleanup()
        return state

    def _inspect(self) -> list[list[str]]:
        """[status, exit code, started, finished, cpus=<its CPUs>, gpus=<its GPUs>] of each container of `_names()`."""
        states = []
        for container in self._names():
            out = _docker(
                "inspect",
                "--format",
                "{{.State.Status}} {{.State.ExitCode}} {{.State.StartedAt}} {{.State.FinishedAt}} "
                "cpus={{.HostConfig.CpusetCpus}} gpus={{range .HostConfig.DeviceRequests}}{{join .DeviceIDs \",\"}}"
                "{{end}}",
                container,
                check=False,
            )
            states.append(out.stdout.split() if out.returncode == 0 else ["missing", "1"])
        return states

    def _failed(self, inspected: list[list[str]]) -> JobState:
        """FAILED, with `exit_code` and `failure` (one line naming it) of the container that failed first."""
        failed = [(s[3] if len(s) > 3 else "", name, s) for name, s in zip(self._names(), inspected, strict=True)
                  if s[0] != "running" and _state(*s[:2]) != JobState.COMPLETE]
        if failed:
            _, name, s = min(failed)
            self.exit_code = int(s[1]) if s[1].lstrip("-").isdigit() else None
            how = "is gone" if s[0] == "missing" else f"{s[0]} with code {s[1]}" + (
                " (killed)" if s[1] == "137" else "")
            self.failure = f"container {name} {how}"
        return JobState.FAILED

    def _mpi_status(self, inspected: list[list[str]]) -> JobState:
        """An MPI run's state: its launcher's (mpirun), or failed as soon as a node stops (its sshd serves until
        the job is removed)."""
        launcher = _state(*inspected[-1][:2])
        if launcher == JobState.COMPLETE:
            return launcher
        if launcher == JobState.FAILED or any(s[0] != "running" for s in inspected[:-1]):
            return self._failed(inspected)
        return launcher

    def _status(self, inspected: list[list[str]]) -> JobState:
        """The job's state from its nodes' `_inspect()`: failed when one failed, complete when all are; an
        elastic run's, complete when a node completed and none runs (a lost node is not the job's failure)."""
        if self._cancelled:
            return JobState.CANCELLED
        if self._final is not None:
            return self._final
        if self.mpi_launcher:
            return self._mpi_status(inspected)
        states = [_state(*s[:2]) for s in inspected]
        if self.elastic and JobState.RUNNING not in states:  # a lost node is no failure while others finish
            return JobState.COMPLETE if JobState.COMPLETE in states else JobState.FAILED
        if self.elastic:
            return JobState.RUNNING
        if JobState.FAILED in states:
            return self._failed(inspected)
        if all(s == JobState.COMPLETE for s in states):
            return JobState.COMPLETE
        return JobState.RUNNING if JobState.RUNNING in states else JobState.CREATED

    def status(self) -> JobState:
        return self._status([] if self._cancelled or self._final else self._inspect())

    def info(self) -> JobInfo:
        inspected = self._inspect()
        state = self._status(inspected)
        starts = [t for s in inspected if len(s) > 2 and (t := _time(s[2]))]
        ends = [t for s in inspected if len(s) > 3 and (t := _time(s[3]))]
        progress = read_progress(self.run_dir) if self.run_dir else {}
        return JobInfo(
            self.name,
            "docker",
            state,
            self.run_dir,
            **progress,
            start_time=min(starts, default=None),
            end_time=max(ends, default=None) if state.finished else None,
            steps=sorted((Step(step, _state(*s[:2]), container, *_device(s[4:])) for step, container, s in
                          zip(self._steps(), self._names(), inspected, strict=True)), key=lambda s: int(s.name[5:])),
        )

    def _steps(self) -> list[str]:
        """Kubeflow's step of each of `_names()`: node-<i>, or under MPI the launcher node-0 and node i node-<i+1>."""
        shift = 1 if self.mpi_launcher else 0
        return [f"node-{n + shift}" for n in range(self.nnodes)] + (["node-0"] if self.mpi_launcher else [])

    def step_logs(self, step: str, follow: bool = False) -> Iterator[str]:
        """Lines of step `step`'s container (an MPI run's node-0: its launcher, whose mpirun prints every rank's)."""
        steps = self._steps()
        check_step(step, sorted(steps, key=lambda s: int(s[5:])), self.name)
        return self._container_logs(self._names()[steps.index(step)], follow)

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        """Lines of node `rank`'s container; of an MPI run's launcher, whose mpirun prints every rank's."""
        return self._container_logs(f"{self.name}-launcher" if self.mpi_launcher else self._container(rank), follow)

    def _container_logs(self, container: str, follow: bool) -> Iterator[str]:
        args = ["docker", "logs", *(["--follow"] if follow else []), container]
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                yield line.rstrip("\n")

    def cancel(self) -> None:
        """Remove the containers, and the network if the job created it."""
        self._cleanup()
        self._cancelled = True


# The SDK's one-off container command for a runtime's packages (its Container backend).
PACKAGES_SCRIPT = ("python -c \"import sys; print(f'Python: {sys.version}')\" && (pip list || echo 'pip not found') "
                   "&& (nvidia-smi || echo 'nvidia-smi not found')")


class DockerLauncher(Backend):
    name = "docker"

    def __init__(self, options: Mapping[str, Any]):
        self.options = dict(options)

    def runtime_image(self, unit: Runtime) -> str:
        return self.options.get("image") or UNKNOWN

    def device(self) -> tuple[str, str]:
        gpus = int(self.options.get("gpus_per_node") or 0)
        return ("gpu", str(gpus)) if gpus else ("cpu", UNKNOWN)

    def get_runtime_packages(self, name: str) -> str:
        """What the launcher's image holds, from a one-off container (the SDK Container backend's command)."""
        runtime_unit(name)
        image = self.given.get("image")
        if not image:
            raise ValueError("image=None: launcher=docker shows the packages of its image: give Client('docker', "
                             "image='...')")
        if not shutil.which("docker"):
            raise RuntimeError("launcher=docker: the docker CLI is not on PATH")
        proc = subprocess.run(["docker", "run", "--rm", "--entrypoint", "bash", image, "-lc", PACKAGES_SCRIPT],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"docker run {image} exited with code {proc.returncode}: "
                               f"{' | '.join(proc.stderr.strip().splitlines()[-3:])}")
        return proc.stdout

    def cache_containers(self, spec: LaunchSpec) -> list[str]:
        return [f"{job_name(spec)}-cache-{i}" for i in range(spec.cache_nodes.count if spec.cache_nodes else 0)]

    def rendezvous_container(self, spec: LaunchSpec) -> str:
        return f"{job_name(spec)}-rdzv"

    def commands(self, spec: LaunchSpec) -> list[list[str]]:
        """The docker commands that start `spec`: the network, the data cache nodes (`data.cache.nodes`),
        then one detached container per node."""
        lc = self.options
        spec = credentials.with_credentials(spec)
        _check_spec(spec, str(lc.get("image") or ""))
        if spec.runtime is None:
            raise LauncherError("launcher=docker runs a runtime on every node: add runtime=torch-distributed")
        name = job_name(spec)
        network = lc.get("network") or name
        env = {
            "PYTHONUNBUFFERED": "1",
            **spec.runtime.unit.agent_env(spec.runtime.options),
            **spec.env,
            **{str(k): str(v) for k, v in (lc.get("env") or {}).items()},
        }
        if spec.cache_dir:
            env["TRAINJOB_CACHE"] = spec.cache_dir
        cmds = [] if lc.get("network") else [["docker", "network", "create", "--label", f"{RUN_LABEL}={name}", network]]
        lay = _mpi_layout(spec)
        user, user_env, user_opts = _user(lay.home if lay else HOME)
        env = {**user_env, **env}

        def container(cname: str, role: str) -> list[str]:
            return _docker_run(spec, lc, cname, role, f"{RUN_LABEL}={name}", network, (user, user_opts), env)

        nodes = spec.cache_nodes
        caches = self.cache_containers(spec)
        for i, cname in enumerate(caches):
            cmds.append(
                [
                    *container(cname, "cache"),
                    lc["image"],
                    "python",
                    *nodes.argv(spec.config_path, i, "0.0.0.0", nodes.port, nodes.eval_port),
                ]
            )
        if nodes:
            env.update(
                nodes.env([f"grpc://{c}:{nodes.port}" for c in caches], [f"grpc://{caches[0]}:{nodes.eval_port}"])
            )
        endpoint = f"{name}-node-0:{RDZV_PORT}"
        if spec.elastic:  # the store in a container of its own, so that losing any node leaves it
            endpoint = f"{self.rendezvous_container(spec)}:{RDZV_PORT}"
            cmds.append([*container(self.rendezvous_container(spec), "rendezvous"), lc["image"],
                         *spec.runtime.unit.store_command("python", f"0.0.0.0:{RDZV_PORT}")])
        shares = cpu_shares(spec.nnodes, lc.get("cpus_per_node"), host_cpus())
        # Each rank's threads: its share of its node's CPUs (launcher.env may set its own).
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(shares[0]) // spec.nproc_per_node)))
        if lay:
            return self._mpi_commands(spec, lay, cmds, container, shares, env, user_env["USER"])
        if spec.runtime.unit.imports or spec.runtime.unit.libraries:  # what its ranks need, found in the image first
            cmds.insert(0, ssh.check_command(name, lc["image"], spec.runtime.unit))
        venv = f"{HOME}/venv"
        for node in range(spec.nnodes):
            cmd = self._host(container(f"{name}-node-{node}", "node"), node, shares)
            run = node_command(spec, _python(spec, venv), endpoint=endpoint, node=node)
            cmds.append([*cmd, lc["image"], *(packages.command("python", venv, spec.packages, run) if spec.packages
                                              else run)])
        return cmds

    def _host(self, cmd: list[str], host: int, shares: list[list[int]]) -> list[str]:
        """`cmd` (a `docker run` of the `host`-th container that runs ranks) given that host's CPUs and GPUs."""
        at = cmd.index("--shm-size")
        cmd[at:at] = ["--cpuset-cpus", ",".join(map(str, shares[host]))]
        if self.options.get("gpus_per_node"):
            cmd[at:at] = ["--gpus", gpu_devices(host, int(self.options["gpus_per_node"]))]
        return cmd

    def _mpi_commands(self, spec: LaunchSpec, lay: ssh.Layout, cmds: list[list[str]], container: Any,
                      shares: list[list[int]], env: dict[str, str], user: str) -> list[list[str]]:
        """`cmds` with an MPI run's containers, as Kubeflow lays them out (`launchers.docker.ssh`): first the
        job's keys (an image without OpenMPI or sshd refuses there, before anything else starts), then the nodes'
        sshd, then the launcher, whose mpirun reads Kubeflow's OMPI_MCA_* settings from its environment, passes the
        environment on to every rank and reaches the hosts over SSH; the first `nnodes` hosts that mpirun fills run
        the ranks, each on its own CPUs."""
        name, image = job_name(spec), self.options["image"]
        placed = lay.ssh.placement(lay.hosts, lay.launcher)
        cmds.insert(0, ssh.keygen_command(name, image, user, lay.home, spec.runtime.unit))
        for cname in [*lay.nodes, lay.launcher]:
            launcher = cname == lay.launcher
            cmd = container(cname, "launcher" if launcher else "node")
            host = placed.index(cname) if cname in placed else spec.nnodes
            if host < spec.nnodes:
                cmd = self._host(cmd, host, shares)
            at = cmd.index("--shm-size")
            cmd[at:at] = ssh.volumes(name, lay, launcher)
            if launcher:
                kubeflow = lay.ssh.launcher_env(spec.nproc_per_node)
                cmd[at:at] = [a for k, v in kubeflow.items() for a in ("--env", f"{k}={v}")]
                names = (*env, *sorted(spec.secrets), "PATH")  # the remote ranks inherit nothing of the launcher
                venv = f"{lay.home}/venv"
                run = node_command(spec, _python(spec, venv), hosts=tuple(placed), env_names=names)
                if spec.packages:  # first once on each host, each into its own container's HOME
                    install = lay.ssh.on_each_host(packages.command("python", venv, spec.packages), names)
                    run = ["bash", "-c", f"{shlex.join(install)} && exec {shlex.join(run)}"]
            else:
                run = lay.ssh.sshd_command(lay.ssh_dir)
            cmds.append([*cmd, image, *run])
        return cmds

    def render(self, spec: LaunchSpec) -> str:
        return "".join(shlex.join(c) + "\n" for c in self.commands(spec))

    def _wait_ready(self, spec: LaunchSpec, timeout: float = 600.0) -> None:
        """Until every cache container answers `python -m datacache ready` from inside itself."""
        nodes, deadline = spec.cache_nodes, time.monotonic() + timeout
        for i, cname in enumerate(self.cache_containers(spec)):
            ports = [nodes.port] + ([nodes.eval_port] if i == 0 else [])
            for port in ports:
                while (
                    _docker(
                        "exec",
                        cname,
                        "python",
                        "-m",
                        "datacache",
                        "ready",
                        f"grpc://127.0.0.1:{port}",
                        check=False,
                        env=spec.secrets,
                    ).returncode
                    != 0
                ):
                    state = _docker("inspect", "--format", "{{.State.Status}}", cname, check=False).stdout.strip()
                    if state != "running" or time.monotonic() > deadline:
                        logs = _docker("logs", "--tail", "3", cname, check=False)
                        raise LauncherError(
                            f"cache node {cname} is {state or 'gone'} and not serving: "
                            + " | ".join((logs.stdout + logs.stderr).strip().splitlines())
                        )
                    time.sleep(1.0)

    def launch(self, spec: LaunchSpec) -> Job:
        spec = credentials.with_credentials(spec)  # the storage credentials, by name, as the commands have them
        cmds = self.commands(spec)
        lc, name = self.options, job_name(spec)
        own_network = not lc.get("network")
        if lc.get("gpus_per_node"):
            have, want = host_gpus(), spec.nnodes * int(lc["gpus_per_node"])
            if have is not None and want > have:
                raise LauncherError(
                    f"runtime.nnodes={spec.nnodes} x launcher.gpus_per_node={lc['gpus_per_node']} = "
                    f"{want} GPUs, and this host has {have}"
                )
        cpus = host_cpus()
        per_node = len(cpu_shares(spec.nnodes, lc.get("cpus_per_node"), cpus)[0])
        if spec.nnodes * per_node > len(cpus):
            raise LauncherError(
                f"runtime.nnodes={spec.nnodes} x {per_node} CPUs per node (launcher.cpus_per_node) = "
                f"{spec.nnodes * per_node} CPUs, and this process may use {len(cpus)} of this host's: every node "
                "runs here, so lower runtime.nnodes or launcher.cpus_per_node"
            )
        leftovers = _containers(name)
        running = [c["name"] for c in leftovers if c["state"] in ("running", "restarting", "paused")]
        if running:
            raise LauncherError(
                f"an earlier attempt of this run is still running ({', '.join(running)}): "
                "stop it first (docker rm -f ...)"
            )
        _remove(name, [c["name"] for c in leftovers], own_network)
        lay = _mpi_layout(spec)
        if lay:
            ssh.make_key_dir(name, lay, spec.nproc_per_node)
        started: list[str] = []
        caches = self.cache_containers(spec)
        for cmd in cmds:
            container = cmd[cmd.index("--name") + 1] if cmd[1] == "run" else None
            if container == f"{name}-node-0" and caches:
                try:
                    self._wait_ready(spec)  # the ranks start once their cache nodes serve
                except LauncherError:
                    _remove(name, started, own_network)
                    raise
            proc = _docker(*cmd[1:], env=spec.secrets, check=False)
            if proc.returncode != 0:
                _remove(name, started, own_network)  # nothing half-started stays behind
                if proc.returncode == ssh.NO_MPI and container in (ssh.keys_container(name), ssh.check_container(name)):
                    raise LauncherError(_reason(proc.stderr))
                what = f"container {container}" if container else f"network {cmd[-1]}"
                raise LauncherError(
                    f"docker could not start {what}: {_reason(proc.stderr)}; removed what this launch had started"
                )
            if container and "--rm" not in cmd:
                started.append(container)
        return DockerJob(name, spec.run_dir, len(lay.nodes) if lay else spec.nnodes, own_network, caches, spec.elastic,
                         lay is not None)

    def _jobs(self) -> dict[str, DockerJob]:
        found: dict[str, list[dict[str, str]]] = {}
        for c in _containers():
            found.setdefault(c["run"], []).append(c)
        own = not self.options.get("network")
        return {
            name: DockerJob(
                name,
                cs[0].get("run_dir") or None,
                sum(c.get("role") == "node" for c in cs),
                own,
                sorted(c["name"] for c in cs if c.get("role") == "cache"),
                any(c.get("role") == "rendezvous" for c in cs),
                any(c.get("role") == "launcher" for c in cs),
            )
            for name, cs in sorted(found.items())
        }

    def jobs(self) -> list[Job]:
        """The runs whose containers are on this host (a finished run's go once something waited for it)."""
        return list(self._jobs().values())

    def job(self, name: str) -> Job:
        jobs = self._jobs()
        if name not in jobs:
            raise LauncherError(f"no docker job {name!r} on this host (docker ps --all --filter label={RUN_LABEL})")
        return jobs[name]


def _mpi_layout(spec: LaunchSpec) -> ssh.Layout | None:
    """The containers of a job whose runtime starts its ranks from one launcher over SSH; None for another."""
    if not spec.runtime.unit.hosts_over_ssh:
        return None
    options = spec.runtime.options  # a function-only MPI runtime (mlx-distributed) has no SSH keys of its own
    return ssh.layout(job_name(spec), spec.runtime.unit, spec.nnodes, bool(options.get("run_launcher_as_node")),
                      options.get("ssh_auth_mount_path") or f"{HOME}/.ssh", HOME)


def _python(spec: LaunchSpec, venv: str) -> str:
    """What runs a container's ranks: the image's python, or where the job installs packages, `venv`'s, which each
    node container makes in its own HOME (`launchers.packages`) before its ranks start (the image's environment may
    be root's, and the containers run as the invoking user)."""
    return packages.venv_python(venv) if spec.packages else "python"


def make(options: Mapping[str, Any], scheduler: Mapping[str, Any] | None = None) -> DockerLauncher:
    return DockerLauncher(options)


def _docker_run(spec: LaunchSpec, lc: Mapping[str, Any], cname: str, role: str, run_label: str, network: str,
                user: tuple[str, list[str]], env: Mapping[str, str]) -> list[str]:
    """`docker run` of one container of the run (its image and command follow): its name, network, user,
    labels, the run and cache directories mounted at their paths, and the environment."""
    cmd = [
        "docker",
        "run",
        "--detach",
        "--name",
        cname,
        "--hostname",
        cname,
        "--network",
        network,
        "--user",
        user[0],
        *user[1],
        "--label",
        run_label,
        "--label",
        f"{ROLE_LABEL}={role}",
        "--label",
        f"{DIR_LABEL}={spec.run_dir}",
        "--shm-size",
        lc["shm_size"],
        # docker stop's SIGTERM to SIGKILL: the step in flight and a checkpoint (train.preemption_grace_s)
        *(["--stop-timeout", str(spec.stop_grace_s)] if spec.stop_grace_s is not None else []),
    ]
    for path in [spec.run_dir, *([spec.cache_dir] if spec.cache_dir else [])]:
        cmd += ["--volume", f"{path}:{path}"]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    for key in sorted(spec.secrets):
        cmd += ["--env", key]  # the value comes from the docker CLI's environment
    return cmd + credentials.mounts(spec.secrets)
