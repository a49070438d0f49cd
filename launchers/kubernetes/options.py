"""The Kubernetes launcher's options (`launcher=kubernetes`): their schema and their checks."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from launchers.base import require
from trainjob.runtimes import Offers


@dataclass
class Resources:
    cpu: str | None = None  # each node's CPU request and limit (null: none)
    memory: str | None = None  # each node's memory request and limit (null: none)
    gpu: int = 0  # GPUs per node (nvidia.com/gpu)


@dataclass
class Volume:
    name: str = MISSING  # the volume's name in the pods
    claim: str = MISSING  # a PersistentVolumeClaim in the job's namespace
    mount_path: str = MISSING  # where it is mounted in every node's container
    read_only: bool = False  # mount it read-only


@dataclass
class KubernetesLauncherConfig:
    name: str = "kubernetes"  # the option chosen
    image: str = MISSING  # the image every node's pod runs (built from the repository's Dockerfile)
    namespace: str = "default"  # the namespace of the TrainJob and its ConfigMap
    context: str | None = None  # the kubeconfig context (null: the current one)
    kubeconfig: str | None = None  # null: $KUBECONFIG or ~/.kube/config, else the in-cluster config
    # The ClusterTrainingRuntime every job runs on by name, creating no runtime of its own (an admin applies it once:
    # `python -m launchers.kubernetes.cluster_runtimes` prints trainjob's); null: each job derives a TrainingRuntime
    # from the runtime's shipped one (torch-distributed), with the failure policies, pod group and initializers.
    runtime_ref: str | None = None
    # The Secret (in the namespace) holding the storage credentials: Kubeflow's initializers take it whole
    # (secretRef: ACCESS_TOKEN for hf://; ACCESS_KEY_ID, SECRET_ACCESS_KEY, ENDPOINT, REGION for s3://), and the
    # ranks those keys as HF_TOKEN and AWS_* (a checkpoint_dir in a bucket). Null: no credentials.
    storage_secret: str | None = None
    job_name: str | None = None  # null: derived from the run directory's name, plus a unique suffix
    resources_per_node: Resources = field(default_factory=Resources)
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables of every node's container
    active_deadline_seconds: int | None = None  # seconds the job may run before it is failed (null: no limit)
    suspend: bool = False  # submit the TrainJob suspended (spec.suspend), to be resumed later
    node_selector: dict[str, str] = field(default_factory=dict)  # the pods' nodeSelector
    tolerations: list[dict[str, Any]] = field(default_factory=list)  # the pods' tolerations
    # PersistentVolumeClaims mounted in every node's pod (name, claim, mount_path, read_only).
    volumes: list[Volume] = field(default_factory=list)
    service_account: str | None = None  # the pods' service account (null: the namespace's default)
    # Where the run directory lives in the pods: under run_root, on the claim run_claim when it is set
    # (shared storage), else on each pod's own disk. local_run_root: the same storage as this machine
    # mounts it, so that `wait=true` can read each run's summary.json.
    run_root: str = "/workspace/runs"
    run_claim: str | None = None  # a PersistentVolumeClaim (ReadWriteMany) holding run_root; null: none
    local_run_root: str | None = None  # run_root as this machine mounts it (null: not mounted here)
    cache_dir: str = "/workspace/cache"  # the data cache's path in the pods
    dry_run: bool = False  # print the manifests and submit nothing
    wait: bool = False  # true: wait for the job to end; false: submit it and print its name
    poll_seconds: float = 10.0  # seconds between two looks at the job's state while waiting


RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RFC1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def offers(options: Mapping[str, Any]) -> Offers:
    """Pods on a cluster: the GPUs each node requests, a fixed node count (a TrainJob's numNodes), failed
    nodes restarted by the JobSet, Kubeflow Trainer's data cache, MPI's launcher and SSH hosts."""
    return Offers(gpus_per_node=int(options["resources_per_node"]["gpu"]), elastic=False, restarts_nodes=True,
                  kubeflow_cache=True, ssh_hosts=True)


def check(lc: Mapping[str, Any], nnodes: int | None, paths: Mapping[str, str]) -> None:
    """The options' rules, for a job of `nnodes` nodes under torchrun (None: no runtime); raises
    OptionError. (`paths` move onto the pods' volumes, so any is fine.)"""
    _check_names(lc, nnodes)
    _check_job(lc, nnodes)


def _check_names(lc: Mapping[str, Any], nnodes: int | None) -> None:
    """The image, the runtime, and the names the cluster will hold (namespace, job)."""
    image = lc["image"]
    require(
        bool(image) and not str(image).startswith("-") and not any(ch.isspace() for ch in str(image)),
        "launcher.image",
        image,
        "launcher=kubernetes needs an image reference such as 'trainjob:latest' (no leading '-', no spaces)",
    )
    require(
        nnodes is not None,
        "runtime",
        None,
        "launcher=kubernetes runs torchrun on every node: add +runtime=torch-distributed",
    )
    require(
        len(lc["namespace"]) <= 63 and bool(RFC1123.match(lc["namespace"])),
        "launcher.namespace",
        lc["namespace"],
        "must be a DNS label: lower-case letters, digits and '-', at most 63 characters",
    )
    for key in ("runtime_ref", "storage_secret"):
        value = lc.get(key)
        require(value is None or (len(value) <= 253 and all(RFC1123.match(p) for p in str(value).split("."))),
                f"launcher.{key}", value, "must be a Kubernetes object name: lower-case letters, digits, '-' and '.'")
    if lc.get("job_name") is not None:
        require(
            len(lc["job_name"]) <= 52 and bool(RFC1035.match(lc["job_name"])),
            "launcher.job_name",
            lc["job_name"],
            "must be an RFC 1035 label (a-z, 0-9, '-', starting with a letter) of at "
            "most 52 characters, leaving room for the pods' suffixes",
        )


def _check_job(lc: Mapping[str, Any], nnodes: int | None) -> None:
    """The job's resources, storage, deadline and environment."""
    gpu = lc["resources_per_node"]["gpu"]
    require(gpu >= 0, "launcher.resources_per_node.gpu", gpu, "must be >= 0")
    require(
        lc["poll_seconds"] is not None and lc["poll_seconds"] > 0,
        "launcher.poll_seconds",
        lc["poll_seconds"],
        "must be > 0",
    )
    nodes = nnodes or 1
    require(
        nodes == 1 or bool(lc.get("run_claim")),
        "launcher.run_claim",
        lc.get("run_claim"),
        f"runtime.nnodes={nodes} needs a shared PersistentVolumeClaim for the run directory: checkpoints "
        "written on each pod's own disk cannot be resumed",
    )
    deadline = lc.get("active_deadline_seconds")
    require(deadline is None or deadline > 0, "launcher.active_deadline_seconds", deadline, "must be > 0, or null")
    for key in lc.get("env") or {}:
        require(
            not str(key).startswith("PET_"),
            f"launcher.env.{key}",
            lc["env"][key],
            "PET_* variables are set by the Kubeflow Trainer torch plugin; torchrun reads them",
        )
    require(
        lc.get("local_run_root") is None or lc.get("run_claim") is not None,
        "launcher.local_run_root",
        lc.get("local_run_root"),
        "is the shared run storage as this machine sees it: set launcher.run_claim too",
    )

