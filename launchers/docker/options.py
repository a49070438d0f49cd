"""The docker launcher's options (`launcher=docker`): their schema and their checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from launchers.base import require
from trainjob.runtimes import Offers


@dataclass
class DockerLauncherConfig:
    name: str = "docker"  # the option chosen
    image: str = MISSING  # the image every node's container runs (built from the repository's Dockerfile)
    network: str | None = None  # null: one per job, named after it
    gpus_per_node: int = 0  # GPUs given to each node's container (docker run --gpus)
    cpus_per_node: int | None = None  # null: this host's CPUs split equally among the nodes
    shm_size: str = "8g"  # each container's /dev/shm (docker run --shm-size)
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables of every container
    dry_run: bool = False  # print the docker commands and start nothing
    wait: bool = True  # true: wait for the run, streaming node 0's logs; false: start it and return


def image_ok(image: Any) -> bool:
    return bool(image) and not str(image).startswith("-") and not any(c.isspace() for c in str(image))


def offers(options: Mapping[str, Any]) -> Offers:
    """Containers on this host: the GPUs each is given, this machine's disk mounted (not read by a dry run), and
    an MPI job's launcher and SSH hosts (`launchers.docker.ssh`)."""
    return Offers(gpus_per_node=int(options["gpus_per_node"]), reads_disk_here=not options.get("dry_run"),
                  ssh_hosts=True, cpus_here=True)


def check(options: Mapping[str, Any], nnodes: int | None, paths: Mapping[str, str]) -> None:
    """The options' rules, for a job of `nnodes` nodes under torchrun (None: no runtime) whose config keys
    `paths` name the host paths mounted into the containers; raises OptionError."""
    require(
        image_ok(options["image"]),
        "launcher.image",
        options["image"],
        "launcher=docker needs an image reference such as 'trainjob:latest' (no leading '-', no spaces)",
    )
    require(
        nnodes is not None,
        "runtime",
        None,
        "launcher=docker runs a runtime's ranks in its containers: add +runtime=torch-distributed (or runtime=mpi)",
    )
    require(options["gpus_per_node"] >= 0, "launcher.gpus_per_node", options["gpus_per_node"], "must be >= 0")
    cpus = options.get("cpus_per_node")
    require(cpus is None or cpus >= 1, "launcher.cpus_per_node", cpus, "must be >= 1, or null for an equal share")
    for key, path in paths.items():  # docker reads ':' in a --volume as its separator
        require(":" not in path, key, path, "must not hold ':' with launcher=docker (docker's volume separator)")
