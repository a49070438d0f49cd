"""Kubeflow Trainer's model and dataset initializers for a run whose `model.path` or `data.path` is a URL (`hf://`,
`s3://`): the TrainJob's `spec.initializer.{model,dataset}.storageUri` (credentials from the Secret
`launcher.storage_secret`, by `secretRef`), the initializer jobs its runtime runs before the nodes (`add_jobs`:
`model-initializer` and `dataset-initializer` writing into the `initializer` claim at /workspace, the `node` job
depending on both being Complete), and the config the ranks read, pointed at what they wrote: /workspace/model and
/workspace/dataset (`pod_paths`). The contract, with its sources: ../shared/reference/kubeflow-trainer-v2.3.0/
INITIALIZERS.md.

The ranks take the same Secret's credentials as the variables their own clients read (`rank_env`: s3fs's AWS_*,
huggingface_hub's HF_TOKEN, each from the initializers' key, optional), for a `train.checkpoint_dir` in a bucket.
No value of the Secret is in any manifest: only its name and keys."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from launchers.base import LaunchSpec

WORKSPACE = "/workspace"  # the initializers' volume, in their pods and the nodes'
PATHS = {"model": f"{WORKSPACE}/model", "dataset": f"{WORKSPACE}/dataset"}
IMAGES = {"model": "ghcr.io/kubeflow/trainer/model-initializer",
          "dataset": "ghcr.io/kubeflow/trainer/dataset-initializer"}
SCHEMES = ("hf", "s3")  # what Kubeflow's initializers fetch (STORAGE_URI's scheme picks the provider)
CLAIM, CLAIM_SIZE = "initializer", "20Gi"  # as Kubeflow's torchtune runtimes declare it
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
# The ranks' variables from the initializers' Secret keys (Kubeflow's names: INITIALIZERS.md's table).
RANK_ENV = {"AWS_ACCESS_KEY_ID": "ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "SECRET_ACCESS_KEY",
            "AWS_ENDPOINT_URL": "ENDPOINT", "AWS_REGION": "REGION", "HF_TOKEN": "ACCESS_TOKEN"}
_GLOB = re.compile(r"[*?\[]")


def _scheme(path: Any) -> str | None:
    head, sep, _ = str(path or "").partition("://")
    return head.lower() if sep else None


def _split(kind: str, url: str) -> tuple[str, str]:
    """(storageUri, the path under the initializer's directory) of `url`: a dataset's glob stays with the ranks
    (`s3://b/corpus/*.parquet` -> `s3://b/corpus`, `*.parquet`; `hf://datasets/org/name/x/*.jsonl` -> `hf://org/name`,
    `x/*.jsonl`); a model is the whole URL (`hf://org/name`, `s3://b/models/tiny`)."""
    scheme, rest = url.split("://", 1)
    if kind == "model":
        return url.rstrip("/"), ""
    parts = rest.strip("/").split("/")
    if scheme == "hf":
        parts = parts[1:] if parts[0] == "datasets" else parts
        return f"hf://{'/'.join(parts[:2])}", "/".join(parts[2:])
    first_glob = next((i for i, p in enumerate(parts) if _GLOB.search(p)), len(parts))
    return f"s3://{'/'.join(parts[:first_glob])}", "/".join(parts[first_glob:])


def uris(config: Mapping[str, Any] | None) -> dict[str, tuple[str, str]]:
    """For each initializer the run needs ("model", "dataset"): (storageUri, the path under its directory)."""
    found = {}
    for kind, section in (("model", "model"), ("dataset", "data")):
        path = ((config or {}).get(section) or {}).get("path")
        if _scheme(path) in SCHEMES:
            found[kind] = _split(kind, str(path))
    return found


def pod_paths(config: dict[str, Any]) -> None:
    """`config` (the ranks' copy) in place: each URL an initializer fetches replaced by where it wrote it."""
    for kind, (_, below) in uris(config).items():
        section = "model" if kind == "model" else "data"
        config[section]["path"] = f"{PATHS[kind]}/{below}".rstrip("/")


def trainjob_initializer(spec: LaunchSpec, secret: str | None) -> dict[str, Any]:
    """The TrainJob's `spec.initializer` for the run's URLs (empty where it has none)."""
    return {kind: {"storageUri": uri, **({"secretRef": {"name": secret}} if secret else {})}
            for kind, (uri, _) in uris(spec.config).items()}


def rank_env(secret: str | None) -> list[dict[str, Any]]:
    """The ranks' storage credentials, each from its key of `secret` when the Secret holds it."""
    if not secret:
        return []
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
            for name, key in RANK_ENV.items()]


def add_jobs(runtime_spec: dict[str, Any], kinds, image_of: Mapping[str, str] | None = None) -> None:
    """A runtime's `spec` in place: the initializer job of each of `kinds` ("model", "dataset") before the
    `node` job, which depends on each being Complete, all mounting the `initializer` claim at /workspace."""
    template = runtime_spec["template"]["spec"]
    template.setdefault("volumeClaimPolicies", [{"templates": [{
        "metadata": {"name": CLAIM},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": CLAIM_SIZE}}}}]}])
    mount = {"name": CLAIM, "mountPath": WORKSPACE}
    jobs = template["replicatedJobs"]
    node = next(job for job in jobs if job["name"] == "node")
    for kind in sorted(kinds):  # dataset-initializer, then model-initializer, as Kubeflow lists them
        name = f"{kind}-initializer"
        if any(job["name"] == name for job in jobs):
            continue
        container = {"name": name, "image": (image_of or IMAGES)[kind], "volumeMounts": [dict(mount)]}
        jobs.insert(jobs.index(node), {"name": name, "template": {
            "metadata": {"labels": {ANCESTOR_LABEL: name}},
            "spec": {"template": {"spec": {"containers": [container]}}}}})
        node.setdefault("dependsOn", []).append({"name": name, "status": "Complete"})
    for container in node["template"]["spec"]["template"]["spec"]["containers"]:
        if container["name"] == "node" and mount not in container.setdefault("volumeMounts", []):
            container["volumeMounts"].append(copy.deepcopy(mount))
