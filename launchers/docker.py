"""The Docker launcher: one container per node on one user-defined network of this host.

Node `i` is container `<job>-node-<i>`; torchrun on every node meets at a c10d rendezvous on node 0,
reached by its container name on the job's network. The run directory and the data cache are mounted
at the same paths as on this host, so the resolved config and the worker command are the launcher's
usual ones. Data cache nodes (`data.cache.nodes`) run as containers `<job>-cache-<i>` of the same image
on the network, and the ranks start once each answers `python -m datacache ready`. Node `i` gets GPUs
`i*g .. i*g+g-1` of the host (`launcher.gpus_per_node=g`). Secrets reach the containers as environment
variables named on the command line and valued from the docker CLI's own environment, so no value shows
in `ps` or in the printed commands. A relaunch of the same run
directory first removes the last attempt's stopped containers and network; a launch that fails half way
removes what it started; containers are removed once the job has finished (the logs are in the run
directory). It drives the `docker` CLI; `launcher.dry_run=true` prints the commands instead.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from launchers.base import (
    TORCHRUN_ENV,
    Job,
    JobState,
    Launcher,
    LauncherError,
    PollingJob,
    Run,
    run_name,
    torchrun_args,
    worker_command,
)

RDZV_PORT = 29400


def job_name(run: Run) -> str:
    return run_name(run.run_dir, max_len=49)


def check(run: Run) -> None:
    """What Docker would misread: an image that looks like a flag, a run directory with ':' (the volume
    separator)."""
    image = str(run.config["launcher"].get("image") or "")
    if not image or image.startswith("-") or any(c.isspace() for c in image):
        raise LauncherError(f"launcher.image={image!r}: give an image reference such as 'trainjob:latest' "
                            "(not empty, no leading '-', no spaces)")
    for path in (run.run_dir, os.path.expanduser(run.config["data"]["cache_dir"])):
        if ":" in path:
            raise LauncherError(f"{path!r} holds ':', which docker reads as a volume separator: choose a run "
                                "directory (hydra.run.dir) and data.cache_dir without ':'")


def gpu_devices(node: int, per_node: int) -> str:
    """The `--gpus` value that gives node `node` its own GPUs (docker's CSV form needs the quotes)."""
    return '"device=' + ",".join(str(node * per_node + i) for i in range(per_node)) + '"'


def host_gpus() -> int | None:
    """How many GPUs this host has, when nvidia-smi can tell."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else None


def cache_containers(run: Run) -> list[str]:
    return [f"{job_name(run)}-cache-{i}" for i in range(run.cache_nodes.count if run.cache_nodes else 0)]


def commands(run: Run) -> list[list[str]]:
    """The docker commands that start `run`: the network, the data cache nodes (`data.cache.nodes`), then
    one detached container per node."""
    check(run)
    lc, rt = run.config["launcher"], run.config["runtime"]
    name = job_name(run)
    network = lc.get("network") or name
    nnodes = int(rt["nnodes"])
    nproc = run.world_size // nnodes
    cache = os.path.expanduser(run.config["data"]["cache_dir"])
    env = {"PYTHONUNBUFFERED": "1", **TORCHRUN_ENV, "TRAINJOB_CACHE": cache,
           **{str(k): str(v) for k, v in (lc.get("env") or {}).items()}}
    cmds = [] if lc.get("network") else [["docker", "network", "create", "--label", f"trainjob.run={name}", network]]

    def container(cname: str, role: str) -> list[str]:
        cmd = ["docker", "run", "--detach", "--name", cname, "--hostname", cname, "--network", network,
               "--label", f"trainjob.run={name}", "--label", f"trainjob.role={role}", "--shm-size", lc["shm_size"],
               "--volume", f"{run.run_dir}:{run.run_dir}", "--volume", f"{cache}:{cache}"]
        for key, value in env.items():
            cmd += ["--env", f"{key}={value}"]
        for key in sorted(run.secrets):
            cmd += ["--env", key]  # the value comes from the docker CLI's environment
        return cmd

    nodes = run.cache_nodes
    for i, cname in enumerate(cache_containers(run)):
        cmds.append([*container(cname, "cache"), lc["image"], "python",
                     *nodes.argv(run.config_path, i, "0.0.0.0", nodes.port, nodes.eval_port)])
    if nodes:
        env.update(nodes.env([f"grpc://{c}:{nodes.port}" for c in cache_containers(run)],
                             [f"grpc://{cache_containers(run)[0]}:{nodes.eval_port}"]))
    endpoint = f"{name}-node-0:{RDZV_PORT}"
    for node in range(nnodes):
        cmd = container(f"{name}-node-{node}", "node")
        if lc.get("gpus_per_node"):
            at = cmd.index("--shm-size")
            cmd[at:at] = ["--gpus", gpu_devices(node, int(lc["gpus_per_node"]))]
        cmds.append([*cmd, lc["image"], "torchrun", *torchrun_args(rt, nproc, endpoint=endpoint),
                     *worker_command(run.config_path)])
    return cmds


def _wait_ready(run: Run, timeout: float = 600.0) -> None:
    """Until every cache container answers `python -m datacache ready` from inside itself."""
    nodes, deadline = run.cache_nodes, time.monotonic() + timeout
    for i, cname in enumerate(cache_containers(run)):
        ports = [nodes.port] + ([nodes.eval_port] if i == 0 else [])
        for port in ports:
            while _docker("exec", cname, "python", "-m", "datacache", "ready", f"grpc://127.0.0.1:{port}",
                          check=False, env=run.secrets).returncode != 0:
                state = _docker("inspect", "--format", "{{.State.Status}}", cname, check=False).stdout.strip()
                if state != "running" or time.monotonic() > deadline:
                    logs = _docker("logs", "--tail", "3", cname, check=False)
                    raise LauncherError(f"cache node {cname} is {state or 'gone'} and not serving: "
                                        + " | ".join((logs.stdout + logs.stderr).strip().splitlines()))
                time.sleep(1.0)


def _docker(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(["docker", *args], capture_output=True, text=True,
                              env={**os.environ, **env} if env else None)
    except FileNotFoundError:
        raise LauncherError("launcher=docker needs the docker CLI on PATH") from None
    if check and proc.returncode != 0:
        raise LauncherError(f"docker {' '.join(args[:2])} failed: {proc.stderr.strip()}")
    return proc


def _remove(name: str, containers: list[str], network: str | None) -> None:
    """Remove `containers`, and the job's own network (`network` None) once nothing uses it."""
    if containers:
        _docker("rm", "--force", *containers, check=False)
    if network is None:
        _docker("network", "rm", name, check=False)


def _leftovers(name: str) -> list[tuple[str, str]]:
    """(container, state) of every container an earlier attempt of this run left."""
    out = _docker("ps", "--all", "--filter", f"label=trainjob.run={name}", "--format", "{{.Names}} {{.State}}")
    return [tuple(line.split()[:2]) for line in out.stdout.splitlines() if line.strip()]


class DockerJob(PollingJob):
    def __init__(self, run: Run, name: str, nnodes: int, network: str | None, caches: list[str] | None = None):
        self.run, self.name, self.nnodes, self._network = run, name, nnodes, network
        self._caches = list(caches or [])
        self._cancelled = False
        self._final: JobState | None = None

    def _container(self, node: int) -> str:
        return f"{self.name}-node-{node}"

    def wait(self, timeout: float | None = None) -> JobState:
        state = super().wait(timeout)
        if state.finished and self._final is None:
            self._final = state
            _remove(self.name, [self._container(n) for n in range(self.nnodes)] + self._caches, self._network)
        return state

    def status(self) -> JobState:
        if self._cancelled:
            return JobState.CANCELLED
        if self._final is not None:
            return self._final
        states = []
        for node in range(self.nnodes):
            out = _docker("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self._container(node),
                          check=False)
            states.append(out.stdout.split() if out.returncode == 0 else ["missing", "1"])
        if any((s[0] == "exited" and s[1] != "0") or s[0] == "missing" for s in states):
            return JobState.FAILED
        if all(s[0] == "exited" for s in states):
            return JobState.SUCCEEDED
        return JobState.RUNNING if any(s[0] == "running" for s in states) else JobState.PENDING

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        """Lines of node `rank`'s container."""
        args = ["docker", "logs", *(["--follow"] if follow else []), self._container(rank)]
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                yield line.rstrip("\n")

    def cancel(self) -> None:
        """Remove the containers, and the network if the job created it."""
        _remove(self.name, [self._container(n) for n in range(self.nnodes)] + self._caches, self._network)
        self._cancelled = True


class DockerLauncher(Launcher):
    def __init__(self):
        self._jobs: list[Job] = []

    def launch(self, run: Run) -> Job | None:
        cmds = commands(run)
        if run.config["launcher"].get("dry_run"):
            sys.stdout.write("".join(shlex.join(c) + "\n" for c in cmds))
            return None
        lc, name = run.config["launcher"], job_name(run)
        nnodes = int(run.config["runtime"]["nnodes"])
        if lc.get("gpus_per_node"):
            have, want = host_gpus(), nnodes * int(lc["gpus_per_node"])
            if have is not None and want > have:
                raise LauncherError(f"runtime.nnodes={nnodes} x launcher.gpus_per_node={lc['gpus_per_node']} = "
                                    f"{want} GPUs, and this host has {have}")
        leftovers = _leftovers(name)
        running = [c for c, state in leftovers if state in ("running", "restarting", "paused")]
        if running:
            raise LauncherError(f"an earlier attempt of this run is still running ({', '.join(running)}): "
                                "stop it first (docker rm -f ...)")
        _remove(name, [c for c, _ in leftovers], lc.get("network"))
        started: list[str] = []
        caches = cache_containers(run)
        for cmd in cmds:
            container = cmd[cmd.index("--name") + 1] if cmd[1] == "run" else None
            if container == f"{name}-node-0" and caches:
                try:
                    _wait_ready(run)  # the ranks start once their cache nodes serve
                except LauncherError:
                    _remove(name, started, lc.get("network"))
                    raise
            proc = _docker(*cmd[1:], env=run.secrets, check=False)
            if proc.returncode != 0:
                _remove(name, started, lc.get("network"))  # nothing half-started stays behind
                what = f"container {container}" if container else f"network {cmd[-1]}"
                raise LauncherError(f"docker could not start {what}: {proc.stderr.strip()}; removed what this "
                                    "launch had started")
            if container:
                started.append(container)
        job = DockerJob(run, name, nnodes, lc.get("network"), caches)
        self._jobs.append(job)
        return job

    def list_jobs(self) -> list[Job]:
        return list(self._jobs)


def make(config: dict[str, Any]) -> DockerLauncher:
    return DockerLauncher()
