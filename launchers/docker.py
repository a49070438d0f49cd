"""The Docker launcher: one container per node on one user-defined network of this host.

Node `i` is container `<job>-node-<i>`; torchrun on every node meets at a c10d rendezvous on node 0,
reached by its container name on the job's network. The run directory and the data cache are mounted
at the same paths as on this host, so the resolved config and the worker command are the launcher's
usual ones. It drives the `docker` CLI; `launcher.dry_run=true` prints the commands instead.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
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


def commands(run: Run) -> list[list[str]]:
    """The docker commands that start `run`: the network, then one detached container per node."""
    lc, rt = run.config["launcher"], run.config["runtime"]
    name = job_name(run)
    network = lc.get("network") or name
    nnodes = int(rt["nnodes"])
    nproc = run.world_size // nnodes
    cache = os.path.expanduser(run.config["data"]["cache_dir"])
    env = {"PYTHONUNBUFFERED": "1", **TORCHRUN_ENV, "TRAINJOB_CACHE": cache,
           **{str(k): str(v) for k, v in (lc.get("env") or {}).items()}}
    cmds = [] if lc.get("network") else [["docker", "network", "create", "--label", f"trainjob.run={name}", network]]
    endpoint = f"{name}-node-0:{RDZV_PORT}"
    for node in range(nnodes):
        cmd = ["docker", "run", "--detach", "--name", f"{name}-node-{node}", "--hostname", f"{name}-node-{node}",
               "--network", network, "--label", f"trainjob.run={name}", "--label", f"trainjob.node={node}",
               "--shm-size", lc["shm_size"], "--volume", f"{run.run_dir}:{run.run_dir}",
               "--volume", f"{cache}:{cache}"]
        if lc.get("gpus_per_node"):
            cmd += ["--gpus", str(lc["gpus_per_node"])]
        for key, value in env.items():
            cmd += ["--env", f"{key}={value}"]
        cmd += [lc["image"], "torchrun", *torchrun_args(rt, nproc, endpoint=endpoint),
                *worker_command(run.config_path)]
        cmds.append(cmd)
    return cmds


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(["docker", *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise LauncherError("launcher=docker needs the docker CLI on PATH") from None
    if check and proc.returncode != 0:
        raise LauncherError(f"docker {' '.join(args[:2])} failed: {proc.stderr.strip()}")
    return proc


class DockerJob(PollingJob):
    def __init__(self, run: Run, name: str, nnodes: int, network: str | None):
        self.run, self.name, self.nnodes, self._network = run, name, nnodes, network
        self._cancelled = False

    def _container(self, node: int) -> str:
        return f"{self.name}-node-{node}"

    def status(self) -> JobState:
        if self._cancelled:
            return JobState.CANCELLED
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
        _docker("rm", "--force", *[self._container(n) for n in range(self.nnodes)], check=False)
        if self._network is None:
            _docker("network", "rm", self.name, check=False)
        self._cancelled = True


class DockerLauncher(Launcher):
    def __init__(self):
        self._jobs: list[Job] = []

    def launch(self, run: Run) -> Job | None:
        cmds = commands(run)
        if run.config["launcher"].get("dry_run"):
            sys.stdout.write("".join(shlex.join(c) + "\n" for c in cmds))
            return None
        for cmd in cmds:
            _docker(*cmd[1:])
        job = DockerJob(run, job_name(run), int(run.config["runtime"]["nnodes"]), run.config["launcher"].get("network"))
        self._jobs.append(job)
        return job

    def list_jobs(self) -> list[Job]:
        return list(self._jobs)


def make(config: dict[str, Any]) -> DockerLauncher:
    return DockerLauncher()
