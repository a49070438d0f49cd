"""What a run becomes on Kubernetes: a Kubeflow Trainer v2 TrainJob (`trainer.kubeflow.org/v1alpha1`), the
ConfigMap holding its config, the Secret holding its secrets, and the cache nodes (a StatefulSet behind a
headless Service, or Kubeflow's dataset initializer); and `to_yaml`, the multi-document YAML of them."""

from __future__ import annotations

import copy
import os
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

from launchers.base import MASK, LauncherError, LaunchSpec
from launchers.kubernetes import initializers, schedulers
from trainjob.env import CACHE_ENDPOINTS_ENV
from trainjob.run_files import RunDir
from trainjob.runtimes import Nodes

GROUP, VERSION = schedulers.GROUP, schedulers.VERSION
CONFIG_DIR = "/etc/trainjob"
MANAGER = "trainjob"
MANAGED_BY = {"app.kubernetes.io/managed-by": MANAGER}
RUN_LABEL = "trainjob.dev/run"


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
        initializers.pod_paths(config)  # a model or corpus URL: where its initializer wrote it
        name = os.path.basename(spec.config_path or RunDir.of(spec.run_dir).config)
        files[name] = yaml.safe_dump(config, sort_keys=False)
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
    if spec.runtime is None:
        raise LauncherError("launcher=kubernetes runs a runtime on every node: add runtime=torch-distributed")
    namespace = lc["namespace"]
    labels = {**MANAGED_BY, RUN_LABEL: name}
    kubeflow_cache = spec.cache_nodes.kubeflow if spec.cache_nodes else None
    out: list[dict[str, Any]] = []
    ref = _runtime_ref(spec, lc, sc, name, labels, runtime_spec, out)
    config_map, secret = f"{name}-config", f"{name}-secrets"
    out.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": config_map, "namespace": namespace, "labels": labels},
            "data": pod_files(spec, lc, name),
        }
    )
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
    secret_env = _secret_env(spec, lc, secret)
    env = {
        "PYTHONUNBUFFERED": "1",
        **spec.runtime.unit.agent_env(spec.runtime.options),
        **spec.env,
        **{str(k): str(v) for k, v in (lc.get("env") or {}).items()},
    }
    if kubeflow_cache is not None:
        env.update(kubeflow_cache_endpoints(spec, name, namespace))
    elif spec.cache_nodes:
        out += cache_manifests(spec, lc, name, labels, config_map, secret_env)
        env.update(cache_endpoints(spec, name, namespace))
    trainjob = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": _job_spec(spec, lc, ref, _trainer(spec, lc, sc, env, secret_env), config_map),
    }
    schedulers.apply_to_trainjob(sc, trainjob)
    out.append(trainjob)
    return out


def _secret_env(spec: LaunchSpec, lc: Mapping[str, Any], secret: str) -> list[dict[str, Any]]:
    """The ranks' variables from Secrets, by key, never a value: the run's own (`secret`: spec.secrets) and the
    storage credentials of `launcher.storage_secret`."""
    own = [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}} for k in sorted(spec.secrets)]
    return own + initializers.rank_env(lc.get("storage_secret"))


def _runtime_ref(spec: LaunchSpec, lc: Mapping[str, Any], sc: Mapping[str, Any], name: str, labels: dict[str, str],
                 runtime_spec: dict[str, Any] | None, out: list[dict[str, Any]]) -> dict[str, str]:
    """The runtime the TrainJob runs on: the ClusterTrainingRuntime `launcher.runtime_ref` names (an admin's, such
    as `cluster_runtimes` prints; nothing created per job), else a TrainingRuntime derived from the cluster's,
    carrying the failure policies, the gang scheduler's settings and the run's initializer jobs, appended to `out`;
    Kubeflow's cache runtime as it is (its dataset initializer is the cluster's to define)."""
    kubeflow_cache = spec.cache_nodes.kubeflow if spec.cache_nodes else None
    fetched = initializers.uris(spec.config)
    if kubeflow_cache is not None:
        if sc["name"] in schedulers.NEEDS_RUNTIME:
            raise LauncherError(
                f"data.cache.backend=kubeflow runs on the {KUBEFLOW_CACHE_RUNTIME} runtime, and scheduler={sc['name']} "
                f"would derive a runtime of its own without the dataset initializer: use scheduler=none or kueue, or "
                f"data.cache.backend=trainjob"
            )
        if fetched:
            raise LauncherError("data.cache.backend=kubeflow's dataset initializer is the job's only initializer: "
                                "give model.path and data.path as paths on a volume (launcher.volumes)")
        return {"kind": "ClusterTrainingRuntime", "name": lc.get("runtime_ref") or KUBEFLOW_CACHE_RUNTIME}
    unit = spec.runtime.unit
    if lc.get("runtime_ref"):
        return {"kind": "ClusterTrainingRuntime", "name": lc["runtime_ref"]}
    if not unit.derives_runtime:  # the shipped runtime itself, by name, as Kubeflow's SDK submits a function job
        if sc["name"] in schedulers.NEEDS_RUNTIME or fetched:
            what = f"scheduler={sc['name']}" if not fetched else f"{' and '.join(fetched)} initializers"
            raise LauncherError(f"runtime={unit.name} runs on the cluster's {unit.runtime_ref} runtime itself, and "
                                f"{what} would need a runtime of its own: use scheduler=none or kueue and local "
                                "paths, or launcher.runtime_ref naming a runtime that has them")
        return {"kind": "ClusterTrainingRuntime", "name": unit.runtime_ref}
    out.append(_derived(spec, lc, sc, name, labels, runtime_spec))
    return {"kind": "TrainingRuntime", "name": out[-1]["metadata"]["name"]}


def _derived(spec: LaunchSpec, lc: Mapping[str, Any], sc: Mapping[str, Any], name: str, labels: dict[str, str],
             runtime_spec: dict[str, Any] | None) -> dict[str, Any]:
    """The job's own TrainingRuntime, derived from `runtime_spec` (the cluster's; None: Kubeflow's stock one)."""
    unit, options = spec.runtime.unit, spec.runtime.options
    # The job's own settings of the runtime's mlPolicy where they go beyond the torch plugin's (which reads the
    # TrainJob's numNodes and numProcPerNode): MPI's hostfile slots, implementation and SSH key path.
    policy = {k: v for k, v in unit.ml_policy(options, spec.nnodes, spec.nproc_per_node).items()
              if k not in ("numNodes", "torch")}
    base = runtime_spec or (schedulers.builtin_mpi_runtime(lc["image"]) if unit.hosts_over_ssh
                            else schedulers.builtin_torch_runtime(lc["image"]))
    runtime = schedulers.derived_runtime(
        sc, base, f"{name}-runtime", lc["namespace"], labels, options.get("max_restarts", 0),
        framework=unit.framework, ml_policy=policy)
    initializers.add_jobs(runtime["spec"], initializers.uris(spec.config))
    if unit.hosts_over_ssh:  # every node's ranks run our image (the TrainJob's image is the launcher's alone)
        for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
            for container in job["template"]["spec"]["template"]["spec"]["containers"]:
                if container["name"] == "node":
                    container["image"] = lc["image"]
    return runtime


def cluster_runtime(spec: LaunchSpec, lc: Mapping[str, Any]) -> str | None:
    """The ClusterTrainingRuntime a launch reads: the one a job's runtime is derived from, or `launcher.runtime_ref`,
    which the job runs on as it is (read to find it there); None where the job runs on Kubeflow's cache runtime or
    a function runtime's shipped one."""
    if (spec.cache_nodes and spec.cache_nodes.kubeflow is not None) or not spec.runtime.unit.derives_runtime:
        return None
    return lc.get("runtime_ref") or spec.runtime.unit.runtime_ref


def _trainer(spec: LaunchSpec, lc: Mapping[str, Any], sc: Mapping[str, Any], env: dict[str, str],
             secret_env: list[dict[str, Any]]) -> dict[str, Any]:
    """The TrainJob's `trainer`: the runtime's agent (torchrun on every node, mpirun from the launcher), with the
    run's environment and resources; a function-only runtime's shipped image unless the launcher names one."""
    unit = spec.runtime.unit
    # Restarts are the JobSet's (the derived runtime's failurePolicy), each pod resuming from the claim; on
    # Kubeflow's cache runtime runtime.max_restarts is refused (0), so torchrun in a pod restarts nothing.
    command = unit.kubeflow_command(spec.runtime.options, Nodes(pod_command(spec), nproc_per_node=spec.nproc_per_node,
                                                                env_names=(*env, *(e["name"] for e in secret_env)),
                                                                worker=spec.worker))
    if spec.packages:  # installed once per node before the ranks start
        command = ["bash", "-c", f"{shlex.join(unit.install_command(list(spec.packages), 'python'))} && exec "
                   f"{shlex.join(command)}"]
    trainer: dict[str, Any] = {
        **({"image": lc["image"]} if lc.get("image") or unit.derives_runtime else {}),
        "command": command,
        "numNodes": spec.nnodes,
        # One process per node under the JAX and XGBoost plugins; the others' processes per node.
        **({} if unit.function_only and not unit.hosts_over_ssh else {"numProcPerNode": spec.nproc_per_node}),
        "env": [{"name": k, "value": v} for k, v in env.items()] + secret_env,
    }
    resources = _resources(lc.get("resources_per_node") or {})
    if resources:
        trainer["resourcesPerNode"] = resources
    return trainer


def _job_spec(spec: LaunchSpec, lc: Mapping[str, Any], ref: dict[str, str], trainer: dict[str, Any],
              config_map: str) -> dict[str, Any]:
    """The TrainJob's `spec`: the runtime, the trainer, the pods' volumes (a runtime patch), the initializer."""
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
                                    "name": job,
                                    "template": {"spec": {"template": {"spec": _pod_patch(lc, config_map,
                                                                                         spec.stop_grace_s)}}},
                                }
                                # Under MPI the ranks run on the nodes and the launcher alike: both read the files.
                                for job in (("node", "launcher") if spec.runtime.unit.hosts_over_ssh else ("node",))
                            ]
                        }
                    }
                },
            }
        ],
    }
    if spec.cache_nodes and spec.cache_nodes.kubeflow is not None:
        job_spec["initializer"] = kubeflow_dataset_initializer(spec)
    elif initializers.uris(spec.config):
        job_spec["initializer"] = initializers.trainjob_initializer(spec, lc.get("storage_secret"))
    if lc.get("suspend"):
        job_spec["suspend"] = True
    if lc.get("active_deadline_seconds"):
        job_spec["activeDeadlineSeconds"] = int(lc["active_deadline_seconds"])
    return job_spec


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
    return {CACHE_ENDPOINTS_ENV: f"[{head}]"}


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
    container = _cache_container(spec, lc, name, secret_env, mounts)
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


def _cache_container(spec: LaunchSpec, lc: Mapping[str, Any], name: str, secret_env: list[dict[str, Any]],
                     mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """A cache pod's container: `python -m trainer.data.cache_node` over its shard, ready once it answers."""
    nodes, namespace = spec.cache_nodes, lc["namespace"]
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
    return container


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config in the ConfigMap) as literal blocks, readable in `kubectl get -o yaml`."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False)
