"""The Kubernetes launcher: a run becomes a Kubeflow Trainer v2 TrainJob (`trainer.kubeflow.org/v1alpha1`).

Every node runs `torchrun ... -m trainer.worker /etc/trainjob/config.yaml`; torchrun takes the node count,
processes per node, node rank and master address from the `PET_*` variables that Trainer's torch plugin
injects. The resolved config travels in a ConfigMap mounted into container `node`, and is owned by the
TrainJob so that deleting the job deletes it; the run's secrets (the data cache token) travel in a
Secret, owned the same way, that the pods read through `secretKeyRef`. Data cache nodes
(`data.cache.nodes`) are a StatefulSet behind a headless Service, owned the same way; the TrainJob is
created once their pods are ready. Gang schedulers
(`launchers.schedulers`) add labels, or a namespaced TrainingRuntime derived from the cluster's.
`launcher.dry_run=true` prints the manifests as multi-document YAML for `kubectl apply -f -` (secret
values masked) and submits nothing. A submission that fails removes whatever it had created, and only a
submitted job leaves `<run_dir>/manifests.yaml` (mode 0600, secret values masked).
"""

from __future__ import annotations

import copy
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import yaml
from omegaconf import MISSING

from launchers import schedulers
from launchers.base import (
    MASK,
    TORCHRUN_ENV,
    Job,
    JobInfo,
    JobState,
    Launcher,
    LauncherError,
    LaunchSpec,
    PollingJob,
    read_progress,
    require,
    run_name,
    write_private,
)

GROUP, VERSION = schedulers.GROUP, schedulers.VERSION
CONFIG_DIR = "/etc/trainjob"
MANAGER = "trainjob"
MANAGED_BY = {"app.kubernetes.io/managed-by": MANAGER}
RUN_LABEL = "trainjob.dev/run"


@dataclass
class Resources:
    cpu: str | None = None
    memory: str | None = None
    gpu: int = 0


@dataclass
class Volume:
    name: str = MISSING
    claim: str = MISSING  # a PersistentVolumeClaim in the job's namespace
    mount_path: str = MISSING
    read_only: bool = False


@dataclass
class KubernetesLauncherConfig:
    name: str = "kubernetes"
    image: str = MISSING
    namespace: str = "default"
    context: str | None = None
    kubeconfig: str | None = None  # null: $KUBECONFIG or ~/.kube/config, else the in-cluster config
    # The ClusterTrainingRuntime to run on; null: the runtime's name (torch-distributed).
    runtime_ref: str | None = None
    job_name: str | None = None  # null: derived from the run directory's name, plus a unique suffix
    resources_per_node: Resources = field(default_factory=Resources)
    env: dict[str, str] = field(default_factory=dict)
    active_deadline_seconds: int | None = None
    suspend: bool = False
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[Volume] = field(default_factory=list)
    service_account: str | None = None
    # Where the run directory lives in the pods: under run_root, on the claim run_claim when it is set
    # (shared storage), else on each pod's own disk. local_run_root: the same storage as this machine
    # mounts it, so that `wait=true` can read each run's summary.json.
    run_root: str = "/workspace/runs"
    run_claim: str | None = None
    local_run_root: str | None = None
    cache_dir: str = "/workspace/cache"
    dry_run: bool = False
    wait: bool = False
    poll_seconds: float = 10.0


RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RFC1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check(lc: Mapping[str, Any], nnodes: int | None, paths: Mapping[str, str]) -> None:
    """The options' rules, for a job of `nnodes` nodes under torchrun (None: no runtime); raises
    OptionError. (`paths` move onto the pods' volumes, so any is fine.)"""
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
    if lc.get("job_name") is not None:
        require(
            len(lc["job_name"]) <= 52 and bool(RFC1035.match(lc["job_name"])),
            "launcher.job_name",
            lc["job_name"],
            "must be an RFC 1035 label (a-z, 0-9, '-', starting with a letter) of at "
            "most 52 characters, leaving room for the pods' suffixes",
        )
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


def _set(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        doc = doc[key]
    doc[last] = value


def _quantity(value: Any) -> Any:
    """CPU counts as numbers (as the SDK sends them); anything else ("500m", "3Gi") as given."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _resources(res: Mapping[str, Any]) -> dict[str, Any] | None:
    amounts = {}
    if res.get("cpu") is not None:
        amounts["cpu"] = _quantity(res["cpu"])
    if res.get("memory") is not None:
        amounts["memory"] = str(res["memory"])
    if res.get("gpu"):
        amounts["nvidia.com/gpu"] = int(res["gpu"])
    return {"limits": dict(amounts), "requests": dict(amounts)} if amounts else None


def _pod_patch(lc: Mapping[str, Any], config_map: str, stop_grace_s: int | None) -> dict[str, Any]:
    volumes = [
        {"name": "trainjob-config", "configMap": {"name": config_map}},
        {"name": "trainjob-cache", "emptyDir": {}},
        {
            "name": "trainjob-runs",
            **({"persistentVolumeClaim": {"claimName": lc["run_claim"]}} if lc.get("run_claim") else {"emptyDir": {}}),
        },
    ]
    mounts = [
        {"name": "trainjob-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "trainjob-cache", "mountPath": lc["cache_dir"]},
        {"name": "trainjob-runs", "mountPath": lc["run_root"]},
    ]
    for v in lc.get("volumes") or []:
        volumes.append(
            {"name": v["name"], "persistentVolumeClaim": {"claimName": v["claim"], "readOnly": bool(v["read_only"])}}
        )
        mounts.append({"name": v["name"], "mountPath": v["mount_path"], "readOnly": bool(v["read_only"])})
    pod: dict[str, Any] = {"volumes": volumes, "containers": [{"name": "node", "volumeMounts": mounts}]}
    if lc.get("node_selector"):
        pod["nodeSelector"] = dict(lc["node_selector"])
    if lc.get("tolerations"):
        pod["tolerations"] = [dict(t) for t in lc["tolerations"]]
    if lc.get("service_account"):
        pod["serviceAccountName"] = lc["service_account"]
    if stop_grace_s is not None:  # SIGTERM to SIGKILL: the step in flight and a checkpoint (train.preemption_grace_s)
        pod["terminationGracePeriodSeconds"] = stop_grace_s
    return pod


def pod_files(spec: LaunchSpec, lc: Mapping[str, Any], name: str) -> dict[str, str]:
    """The files the pods read from the ConfigMap (at CONFIG_DIR): the config, with the run directory and
    the data cache moved to their paths in the pod, and the spec's other files."""
    files = dict(spec.files)
    if spec.config is not None:
        config = copy.deepcopy(spec.config)
        moved = {"run_dir": f"{lc['run_root'].rstrip('/')}/{name}", "cache_dir": lc["cache_dir"]}
        for role, key in spec.path_keys.items():
            _set(config, key, moved[role])
        files[os.path.basename(spec.config_path or "config.yaml")] = yaml.safe_dump(config, sort_keys=False)
    return files


def pod_command(spec: LaunchSpec) -> list[str]:
    """The spec's command with the paths of its files on this machine replaced by theirs in the pod."""
    local = {os.path.join(spec.run_dir, f): f"{CONFIG_DIR}/{f}" for f in spec.files}
    if spec.config_path:
        local[spec.config_path] = f"{CONFIG_DIR}/{os.path.basename(spec.config_path)}"
    return [local.get(arg, arg) for arg in spec.command]


def manifests(
    spec: LaunchSpec,
    lc: Mapping[str, Any],
    sc: Mapping[str, Any],
    name: str,
    runtime_spec: dict[str, Any] | None = None,
    reveal: bool = False,
) -> list[dict[str, Any]]:
    """The manifests for `spec`, in the order to create them: [TrainingRuntime,] ConfigMap, [Secret,] TrainJob.

    `runtime_spec` is the cluster runtime's spec, from which a gang scheduler's runtime is derived; None
    uses Kubeflow Trainer's stock torch-distributed spec. Secret values are masked unless `reveal`.
    """
    if spec.torchrun is None:
        raise LauncherError("launcher=kubernetes runs torchrun on every node: add +runtime=torch-distributed")
    namespace = lc["namespace"]
    labels = {**MANAGED_BY, RUN_LABEL: name}
    kubeflow_cache = spec.cache_nodes.kubeflow if spec.cache_nodes else None
    cluster_ref = lc.get("runtime_ref") or (KUBEFLOW_CACHE_RUNTIME if kubeflow_cache else spec.torchrun.name)
    out: list[dict[str, Any]] = []
    if kubeflow_cache is not None and sc["name"] in schedulers.NEEDS_RUNTIME:
        raise LauncherError(
            f"data.cache.backend=kubeflow runs on the {KUBEFLOW_CACHE_RUNTIME} runtime, and scheduler={sc['name']} "
            f"would derive a runtime of its own without the dataset initializer: use scheduler=none or kueue, or "
            f"data.cache.backend=trainjob"
        )

    ref = {"kind": "ClusterTrainingRuntime", "name": cluster_ref}
    if sc["name"] in schedulers.NEEDS_RUNTIME:
        runtime = schedulers.derived_runtime(
            sc, runtime_spec or schedulers.builtin_torch_runtime(lc["image"]), f"{name}-runtime", namespace, labels
        )
        out.append(runtime)
        ref = {"kind": "TrainingRuntime", "name": runtime["metadata"]["name"]}

    config_map = f"{name}-config"
    out.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": config_map, "namespace": namespace, "labels": labels},
            "data": pod_files(spec, lc, name),
        }
    )

    secret = f"{name}-secrets"
    if spec.secrets:
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {"name": secret, "namespace": namespace, "labels": labels},
                "stringData": {k: (v if reveal else MASK) for k, v in sorted(spec.secrets.items())},
            }
        )
    secret_env = [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}} for k in sorted(spec.secrets)]
    env = {
        "PYTHONUNBUFFERED": "1",
        **TORCHRUN_ENV,
        **spec.env,
        **{str(k): str(v) for k, v in (lc.get("env") or {}).items()},
    }
    if kubeflow_cache is not None:
        env.update(kubeflow_cache_endpoints(spec, name, namespace))
    elif spec.cache_nodes:
        out += cache_manifests(spec, lc, name, labels, config_map, secret_env)
        env.update(cache_endpoints(spec, name, namespace))
    trainer: dict[str, Any] = {
        "image": lc["image"],
        "command": ["torchrun", f"--max-restarts={spec.torchrun.max_restarts}", *pod_command(spec)],
        "numNodes": spec.nnodes,
        "numProcPerNode": spec.nproc_per_node,
        "env": [{"name": k, "value": v} for k, v in env.items()] + secret_env,
    }
    resources = _resources(lc.get("resources_per_node") or {})
    if resources:
        trainer["resourcesPerNode"] = resources
    job_spec: dict[str, Any] = {
        "runtimeRef": ref,
        "trainer": trainer,
        "runtimePatches": [
            {
                "manager": f"{MANAGER}.dev/launcher",
                "trainingRuntimeSpec": {
                    "template": {
                        "spec": {
                            "replicatedJobs": [
                                {
                                    "name": "node",
                                    "template": {"spec": {"template": {"spec": _pod_patch(lc, config_map,
                                                                                         spec.stop_grace_s)}}},
                                }
                            ]
                        }
                    }
                },
            }
        ],
    }
    if kubeflow_cache is not None:
        job_spec["initializer"] = kubeflow_dataset_initializer(spec)
    if lc.get("suspend"):
        job_spec["suspend"] = True
    if lc.get("active_deadline_seconds"):
        job_spec["activeDeadlineSeconds"] = int(lc["active_deadline_seconds"])
    trainjob = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": job_spec,
    }
    schedulers.apply_to_trainjob(sc, trainjob)
    out.append(trainjob)
    return out


def cache_endpoints(spec: LaunchSpec, name: str, namespace: str) -> dict[str, str]:
    """The ranks' environment naming the cache pods by their stable DNS names (`<pod>.<service>`)."""
    nodes, service = spec.cache_nodes, f"{name}-cache"
    pods = [f"{service}-{i}.{service}.{namespace}.svc" for i in range(nodes.count)]
    return nodes.env([f"grpc://{p}:{nodes.port}" for p in pods], [f"grpc://{pods[0]}:{nodes.eval_port}"])


KUBEFLOW_CACHE_RUNTIME = "torch-distributed-with-cache"  # Kubeflow Trainer's runtime with a data cache
KUBEFLOW_CACHE_PORT = 50051
# data.cache.kubeflow's keys as the environment of Kubeflow's dataset initializer (CacheDatasetInitializer
# reads each of its fields from the variable of its name in capitals); CLUSTER_SIZE is data.cache.nodes.
KUBEFLOW_INITIALIZER_ENV = {"metadata_loc": "METADATA_LOC", "iam_role": "IAM_ROLE", "head_cpu": "HEAD_CPU",
                            "head_mem": "HEAD_MEM", "worker_cpu": "WORKER_CPU", "worker_mem": "WORKER_MEM"}


def kubeflow_dataset_initializer(spec: LaunchSpec) -> dict[str, Any]:
    """The TrainJob's `initializer` that has Kubeflow's dataset initializer start its cache: the table
    (`storageUri`, cache://<schema>/<table>), its metadata, the number of data nodes and their resources."""
    settings = spec.cache_nodes.kubeflow
    env = [{"name": "CLUSTER_SIZE", "value": str(spec.cache_nodes.count)}]
    env += [{"name": var, "value": str(settings[key])} for key, var in KUBEFLOW_INITIALIZER_ENV.items()
            if settings.get(key) is not None]
    return {"dataset": {"storageUri": str(settings["storage_uri"]), "env": env}}


def kubeflow_cache_endpoints(spec: LaunchSpec, name: str, namespace: str) -> dict[str, str]:
    """The ranks' environment naming Kubeflow's cache head, the Service its initializer makes for the job
    (`<job>-cache-service`), as a StreamingDataset endpoint."""
    head = f"kubeflow+grpc://{name}-cache-service.{namespace}.svc:{KUBEFLOW_CACHE_PORT}"
    return {spec.cache_nodes.ENDPOINTS_ENV: f"[{head}]"}


def cache_manifests(
    spec: LaunchSpec,
    lc: Mapping[str, Any],
    name: str,
    labels: dict[str, str],
    config_map: str,
    secret_env: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """A headless Service and a StatefulSet of `data.cache.nodes` pods, pod i serving shard i of the
    training rows (the index from the pod's `apps.kubernetes.io/pod-index` label), ready once `python -m
    datacache ready` answers inside it; the same image, config and volumes as the ranks."""
    nodes, service, namespace = spec.cache_nodes, f"{name}-cache", lc["namespace"]
    selector = {"trainjob.dev/cache": name}
    pod = _pod_patch(lc, config_map, None)
    mounts = pod.pop("containers")[0]["volumeMounts"]
    index = {
        "name": "POD_INDEX",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
    }
    container = {
        "name": "cache",
        "image": lc["image"],
        "command": [
            "python",
            *nodes.argv(f"{CONFIG_DIR}/config.yaml", "$(POD_INDEX)", "0.0.0.0", nodes.port, nodes.eval_port),
        ],
        # The nodes' own list, the one the ranks get: each node advertises its entry and lists the others,
        # so that any node answers a Kubeflow client for the whole table.
        "env": [index, {"name": "PYTHONUNBUFFERED", "value": "1"}, *secret_env,
                *({"name": k, "value": v} for k, v in cache_endpoints(spec, name, namespace).items())],
        "ports": [{"name": "train", "containerPort": nodes.port}, {"name": "eval", "containerPort": nodes.eval_port}],
        "readinessProbe": {
            "exec": {"command": ["python", "-m", "datacache", "ready", f"grpc://127.0.0.1:{nodes.port}"]},
            "periodSeconds": 5,
            "timeoutSeconds": 30,
        },
        "volumeMounts": mounts,
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": service, "namespace": namespace, "labels": labels},
            "spec": {
                "clusterIP": "None",
                "selector": selector,
                "ports": [{"name": "train", "port": nodes.port}, {"name": "eval", "port": nodes.eval_port}],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": service, "namespace": namespace, "labels": labels},
            "spec": {
                "serviceName": service,
                "replicas": nodes.count,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {"labels": {**labels, **selector}},
                    "spec": {**pod, "containers": [container]},
                },
            },
        },
    ]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config in the ConfigMap) as literal blocks, readable in `kubectl get -o yaml`."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False)


# --- the API -------------------------------------------------------------------------------------------


def _api_error(e, verb: str, kind: str, name: str, namespace: str) -> LauncherError:
    what = f"{verb} {kind} {name!r} in namespace {namespace!r}"
    status = getattr(e, "status", None)
    detail = ""
    try:
        import json

        detail = json.loads(e.body).get("message", "") if getattr(e, "body", None) else ""
    except (ValueError, AttributeError):
        detail = str(getattr(e, "body", "") or "")
    if status == 403:
        msg = f"forbidden to {what}: the account in your kubeconfig lacks the RBAC permission"
    elif status == 404 and kind in ("TrainJob", "ClusterTrainingRuntime", "TrainingRuntime"):
        msg = (
            f"cannot {what}: not found; is Kubeflow Trainer v2 installed, and does the "
            f"ClusterTrainingRuntime exist (kubectl get clustertrainingruntimes)?"
        )
    elif status == 404:
        msg = f"cannot {what}: not found"
    elif status == 409:
        msg = f"cannot {what}: it already exists; delete it or set launcher.job_name to another name"
    elif status == 422:
        msg = f"the API server rejected {what} as invalid"
    else:
        msg = f"cannot {what}: HTTP {status} {getattr(e, 'reason', '')}".rstrip()
    return LauncherError(f"Kubernetes API: {msg}" + (f": {detail}" if detail else ""))


class Api:
    """The few calls the launcher makes, through the official `kubernetes` client."""

    def __init__(self, lc: Mapping[str, Any]):
        from kubernetes import client, config

        try:
            if (
                lc.get("kubeconfig")
                or os.environ.get("KUBECONFIG")
                or os.path.exists(os.path.expanduser("~/.kube/config"))
            ):
                api_client = config.new_client_from_config(config_file=lc.get("kubeconfig"), context=lc.get("context"))
            else:
                config.load_incluster_config()
                api_client = client.ApiClient()
        except config.ConfigException as e:
            raise LauncherError(
                f"no usable Kubernetes config (launcher.kubeconfig={lc.get('kubeconfig')!r}, "
                f"launcher.context={lc.get('context')!r}): {e}"
            ) from None
        api_client.configuration.retries = 1  # an unreachable server: one clear error, soon
        self.host = api_client.configuration.host
        self.custom = client.CustomObjectsApi(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.ApiException = client.exceptions.ApiException

    def call(self, verb: str, kind: str, name: str, namespace: str, fn, *args, **kwargs):
        import urllib3

        try:
            return fn(*args, **kwargs)
        except self.ApiException as e:
            raise _api_error(e, verb, kind, name, namespace) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise LauncherError(
                f"Kubernetes API: cannot reach the API server at {self.host} to {verb} {kind} {name!r}: {reason}"
            ) from None


def _plural(kind: str) -> str:
    return {"TrainJob": "trainjobs", "TrainingRuntime": "trainingruntimes"}[kind]


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


class KubernetesJob(PollingJob):
    def __init__(
        self, api: Api, name: str, namespace: str, poll_seconds: float = 10.0, local_run_root: str | None = None
    ):
        self.api, self.name, self.namespace, self.poll_seconds = api, name, namespace, poll_seconds
        # The run directory as this machine sees the shared storage, when it does.
        self.run_dir = os.path.join(local_run_root, name) if local_run_root else None
        self._cancelled = False

    def _get(self) -> dict[str, Any]:
        return self.api.call(
            "get",
            "TrainJob",
            self.name,
            self.namespace,
            self.api.custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            "trainjobs",
            self.name,
        )

    def _pods(self, node: int | None = None) -> list:
        selector = f"jobset.sigs.k8s.io/jobset-name={self.name}"
        if node is not None:
            selector += f",jobset.sigs.k8s.io/job-index={node}"
        pods = self.api.call(
            "list",
            "Pod",
            selector,
            self.namespace,
            self.api.core.list_namespaced_pod,
            self.namespace,
            label_selector=selector,
        )
        return list(pods.items)

    def _state(self, trainjob: dict[str, Any]) -> JobState:
        conditions = {c["type"]: c.get("status") for c in (trainjob.get("status") or {}).get("conditions", [])}
        if conditions.get("Complete") == "True":
            return JobState.COMPLETE
        if conditions.get("Failed") == "True":
            return JobState.FAILED
        if conditions.get("Suspended") == "True":
            return JobState.CREATED
        # No Running condition exists: a job runs once one of its pods does.
        phases = {p.status.phase for p in self._pods()}
        return JobState.RUNNING if phases & {"Running", "Succeeded"} else JobState.CREATED

    def status(self) -> JobState:
        if self._cancelled:
            return JobState.CANCELLED
        return self._state(self._get())

    def info(self) -> JobInfo:
        """State and times from the TrainJob; the loss and eval loss rank 0 reported in its trainerStatus,
        or the step and losses in the run directory when this machine sees the shared storage."""
        trainjob = self._get()
        state = self._state(trainjob)
        status = trainjob.get("status") or {}
        metrics = {m["name"]: m["value"] for m in (status.get("trainerStatus") or {}).get("metrics", [])}
        progress = {"step": None, "loss": _float(metrics.get("loss")), "eval_loss": _float(metrics.get("eval_loss"))}
        if self.run_dir:
            progress.update({k: v for k, v in read_progress(self.run_dir).items() if v is not None})
        ends = [
            c.get("lastTransitionTime")
            for c in status.get("conditions", [])
            if c["type"] in ("Complete", "Failed") and c.get("status") == "True"
        ]
        return JobInfo(
            self.name,
            "kubernetes",
            state,
            self.run_dir,
            **progress,
            start_time=_time(trainjob["metadata"].get("creationTimestamp")),
            end_time=_time(ends[0]) if ends else None,
        )

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        """Lines of node `rank`'s pod (`<job>-node-<rank>-...`, container `node`)."""
        pods = self._pods(rank)
        if not pods:
            raise LauncherError(f"TrainJob {self.name!r} has no pod for node {rank} (yet)")
        pod = pods[0].metadata.name
        stream = self.api.call(
            "read logs of",
            "Pod",
            pod,
            self.namespace,
            self.api.core.read_namespaced_pod_log,
            pod,
            self.namespace,
            container="node",
            follow=follow,
            _preload_content=False,
        )
        buffer = b""
        for chunk in stream.stream():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", errors="replace")
        if buffer:
            yield buffer.decode("utf-8", errors="replace")

    def cancel(self) -> None:
        """Delete the TrainJob; its ConfigMap and runtime follow through their owner references."""
        self.api.call(
            "delete",
            "TrainJob",
            self.name,
            self.namespace,
            self.api.custom.delete_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            "trainjobs",
            self.name,
            propagation_policy="Foreground",
        )
        self._cancelled = True


def _create(api: Api, m: dict[str, Any], namespace: str) -> Any:
    kind, name = m["kind"], m["metadata"]["name"]
    if kind == "ConfigMap":
        return api.call("create", kind, name, namespace, api.core.create_namespaced_config_map, namespace, m)
    if kind == "Secret":
        return api.call("create", kind, name, namespace, api.core.create_namespaced_secret, namespace, m)
    if kind == "Service":
        return api.call("create", kind, name, namespace, api.core.create_namespaced_service, namespace, m)
    if kind == "StatefulSet":
        return api.call("create", kind, name, namespace, api.apps.create_namespaced_stateful_set, namespace, m)
    return api.call(
        "create",
        kind,
        name,
        namespace,
        api.custom.create_namespaced_custom_object,
        GROUP,
        VERSION,
        namespace,
        _plural(kind),
        m,
    )


CACHE_READY_TIMEOUT = 1800.0  # each cache pod builds the corpus before it serves


def _wait_for_cache(api: Api, name: str, namespace: str, count: int, poll_seconds: float) -> None:
    """Until the cache StatefulSet's pods are all ready (their `python -m datacache ready` probe answers)."""
    deadline = time.monotonic() + CACHE_READY_TIMEOUT
    while True:
        status = api.call(
            "read", "StatefulSet", name, namespace, api.apps.read_namespaced_stateful_set_status, name, namespace
        ).status
        if (status.ready_replicas or 0) >= count:
            return
        if time.monotonic() > deadline:
            raise LauncherError(
                f"the {count} cache pods of StatefulSet {name!r} are not ready after "
                f"{CACHE_READY_TIMEOUT:.0f} s (kubectl describe statefulset {name} -n {namespace})"
            )
        time.sleep(poll_seconds)


def _own(api: Api, m: dict[str, Any], namespace: str, owner: dict[str, Any]) -> None:
    """Make the TrainJob own `m`, so that deleting the job deletes it."""
    kind, name = m["kind"], m["metadata"]["name"]
    patch = {"metadata": {"ownerReferences": [owner]}}
    if kind == "ConfigMap":
        api.call("patch", kind, name, namespace, api.core.patch_namespaced_config_map, name, namespace, patch)
    elif kind == "Secret":
        api.call("patch", kind, name, namespace, api.core.patch_namespaced_secret, name, namespace, patch)
    elif kind == "Service":
        api.call("patch", kind, name, namespace, api.core.patch_namespaced_service, name, namespace, patch)
    elif kind == "StatefulSet":
        api.call("patch", kind, name, namespace, api.apps.patch_namespaced_stateful_set, name, namespace, patch)
    else:
        api.call(
            "patch",
            kind,
            name,
            namespace,
            api.custom.patch_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            _plural(kind),
            name,
            patch,
        )


def _delete(api: Api, m: dict[str, Any], namespace: str) -> None:
    """Best effort: the launch is already failing with its own error."""
    kind, name = m["kind"], m["metadata"]["name"]
    try:
        if kind == "ConfigMap":
            api.call("delete", kind, name, namespace, api.core.delete_namespaced_config_map, name, namespace)
        elif kind == "Secret":
            api.call("delete", kind, name, namespace, api.core.delete_namespaced_secret, name, namespace)
        elif kind == "Service":
            api.call("delete", kind, name, namespace, api.core.delete_namespaced_service, name, namespace)
        elif kind == "StatefulSet":
            api.call("delete", kind, name, namespace, api.apps.delete_namespaced_stateful_set, name, namespace)
        else:
            api.call(
                "delete",
                kind,
                name,
                namespace,
                api.custom.delete_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                _plural(kind),
                name,
            )
    except LauncherError:
        pass


class KubernetesLauncher(Launcher):
    name = "kubernetes"

    def __init__(self, options: Mapping[str, Any], scheduler: Mapping[str, Any] | None = None):
        self.options = dict(options)
        self.scheduler = dict(scheduler or {"name": "none"})
        self._api: Api | None = None

    @property
    def api(self) -> Api:
        if self._api is None:
            self._api = Api(self.options)
        return self._api

    def job_name(self, spec: LaunchSpec) -> str:
        """launcher.job_name, or one derived from the run (see `launchers.base.run_name`)."""
        return self.options.get("job_name") or run_name(spec.run_dir)

    def manifests(
        self, spec: LaunchSpec, runtime_spec: dict[str, Any] | None = None, reveal: bool = False
    ) -> list[dict[str, Any]]:
        return manifests(spec, self.options, self.scheduler, self.job_name(spec), runtime_spec, reveal)

    def render(self, spec: LaunchSpec) -> str:
        """The manifests as multi-document YAML for `kubectl apply -f -`, secret values masked."""
        return to_yaml(self.manifests(spec))

    def _job(self, name: str) -> KubernetesJob:
        return KubernetesJob(
            self.api,
            name,
            self.options.get("namespace", "default"),
            float(self.options.get("poll_seconds", 10.0)),
            self.options.get("local_run_root"),
        )

    def launch(self, spec: LaunchSpec) -> Job:
        lc, api = self.options, self.api
        namespace, name = lc["namespace"], self.job_name(spec)
        runtime_spec = None
        if self.scheduler["name"] in schedulers.NEEDS_RUNTIME:
            ref = lc.get("runtime_ref") or spec.torchrun.name
            runtime_spec = api.call(
                "get",
                "ClusterTrainingRuntime",
                ref,
                namespace,
                api.custom.get_cluster_custom_object,
                GROUP,
                VERSION,
                "clustertrainingruntimes",
                ref,
            )["spec"]
        created: list[dict[str, Any]] = []
        try:
            for m in self.manifests(spec, runtime_spec, reveal=True):
                if m["kind"] == "TrainJob" and spec.cache_nodes and not spec.cache_nodes.kubeflow:
                    _wait_for_cache(
                        api, f"{name}-cache", namespace, spec.cache_nodes.count, float(lc.get("poll_seconds", 10.0))
                    )
                trainjob = _create(api, m, namespace)  # the TrainJob comes last
                created.append(m)
            owner = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "TrainJob",
                "name": name,
                "uid": trainjob["metadata"]["uid"],
                "blockOwnerDeletion": True,
            }
            for m in created[:-1]:
                _own(api, m, namespace, owner)
        except LauncherError:
            # Nothing half-submitted: remove what this launch created, newest first.
            for m in reversed(created):
                _delete(api, m, namespace)
            raise
        write_private(os.path.join(spec.run_dir, "manifests.yaml"), to_yaml(self.manifests(spec, runtime_spec)))
        return self._job(name)

    def list_jobs(self) -> list[Job]:
        """The TrainJobs this launcher submitted in the configured namespace."""
        api, namespace = self.api, self.options.get("namespace", "default")
        found = api.call(
            "list",
            "TrainJob",
            "*",
            namespace,
            api.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            "trainjobs",
            label_selector=f"app.kubernetes.io/managed-by={MANAGER}",
        )
        return [self._job(item["metadata"]["name"]) for item in found.get("items", [])]

    def job(self, name: str) -> Job:
        job = self._job(name)
        job._get()  # a clear error when there is none
        return job


def make(options: Mapping[str, Any], scheduler: Mapping[str, Any] | None = None) -> KubernetesLauncher:
    return KubernetesLauncher(options, scheduler)
