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
import sys
import time
from collections.abc import Iterator
from typing import Any

import yaml

from launchers import schedulers
from launchers.base import (
    MASK,
    TORCHRUN_ENV,
    Job,
    JobState,
    Launcher,
    LauncherError,
    PollingJob,
    Run,
    read_summary,
    run_name,
    worker_command,
    write_private,
)

GROUP, VERSION = schedulers.GROUP, schedulers.VERSION
CONFIG_DIR = "/etc/trainjob"
MANAGER = "trainjob"
MANAGED_BY = {"app.kubernetes.io/managed-by": MANAGER}
RUN_LABEL = "trainjob.dev/run"


def job_name(run: Run) -> str:
    """The launcher's job_name, or one derived from the run (see `launchers.base.run_name`)."""
    return run.config["launcher"].get("job_name") or run_name(run.run_dir)


def pod_config(run: Run, name: str) -> dict[str, Any]:
    """The run's config as the pods see it: run directory and data cache at their paths in the pod."""
    config = copy.deepcopy(run.config)
    lc = config["launcher"]
    config["run_dir"] = f"{lc['run_root'].rstrip('/')}/{name}"
    config["data"]["cache_dir"] = lc["cache_dir"]
    return config


def _quantity(value: Any) -> Any:
    """CPU counts as numbers (as the SDK sends them); anything else ("500m", "3Gi") as given."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _resources(res: dict[str, Any]) -> dict[str, Any] | None:
    amounts = {}
    if res.get("cpu") is not None:
        amounts["cpu"] = _quantity(res["cpu"])
    if res.get("memory") is not None:
        amounts["memory"] = str(res["memory"])
    if res.get("gpu"):
        amounts["nvidia.com/gpu"] = int(res["gpu"])
    return {"limits": dict(amounts), "requests": dict(amounts)} if amounts else None


def _pod_patch(lc: dict[str, Any], config_map: str) -> dict[str, Any]:
    volumes = [{"name": "trainjob-config", "configMap": {"name": config_map}},
               {"name": "trainjob-cache", "emptyDir": {}},
               {"name": "trainjob-runs", **({"persistentVolumeClaim": {"claimName": lc["run_claim"]}}
                                            if lc.get("run_claim") else {"emptyDir": {}})}]
    mounts = [{"name": "trainjob-config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "trainjob-cache", "mountPath": lc["cache_dir"]},
              {"name": "trainjob-runs", "mountPath": lc["run_root"]}]
    for v in lc.get("volumes") or []:
        volumes.append({"name": v["name"], "persistentVolumeClaim": {"claimName": v["claim"],
                                                                     "readOnly": bool(v["read_only"])}})
        mounts.append({"name": v["name"], "mountPath": v["mount_path"], "readOnly": bool(v["read_only"])})
    pod: dict[str, Any] = {"volumes": volumes, "containers": [{"name": "node", "volumeMounts": mounts}]}
    if lc.get("node_selector"):
        pod["nodeSelector"] = dict(lc["node_selector"])
    if lc.get("tolerations"):
        pod["tolerations"] = [dict(t) for t in lc["tolerations"]]
    if lc.get("service_account"):
        pod["serviceAccountName"] = lc["service_account"]
    return pod


def render(run: Run, runtime_spec: dict[str, Any] | None = None, reveal: bool = False) -> list[dict[str, Any]]:
    """The manifests for `run`, in the order to create them: [TrainingRuntime,] ConfigMap, [Secret,] TrainJob.

    `runtime_spec` is the cluster runtime's spec, from which a gang scheduler's runtime is derived; None
    uses Kubeflow Trainer's stock torch-distributed spec. Secret values are masked unless `reveal`.
    """
    lc, sc, rt = run.config["launcher"], run.config["scheduler"], run.config["runtime"]
    name, namespace = job_name(run), lc["namespace"]
    labels = {**MANAGED_BY, RUN_LABEL: name}
    cluster_ref = lc.get("runtime_ref") or rt["name"]
    manifests: list[dict[str, Any]] = []

    ref = {"kind": "ClusterTrainingRuntime", "name": cluster_ref}
    if sc["name"] in schedulers.NEEDS_RUNTIME:
        runtime = schedulers.derived_runtime(sc, runtime_spec or schedulers.builtin_torch_runtime(lc["image"]),
                                             f"{name}-runtime", namespace, labels)
        manifests.append(runtime)
        ref = {"kind": "TrainingRuntime", "name": runtime["metadata"]["name"]}

    config_map = f"{name}-config"
    manifests.append({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": config_map, "namespace": namespace, "labels": labels},
        "data": {"config.yaml": yaml.safe_dump(pod_config(run, name), sort_keys=False)},
    })

    secret = f"{name}-secrets"
    if run.secrets:
        manifests.append({
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret, "namespace": namespace, "labels": labels},
            "stringData": {k: (v if reveal else MASK) for k, v in sorted(run.secrets.items())},
        })
    secret_env = [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}} for k in sorted(run.secrets)]
    env = {"PYTHONUNBUFFERED": "1", **TORCHRUN_ENV, **{str(k): str(v) for k, v in (lc.get("env") or {}).items()}}
    if run.cache_nodes:
        manifests += cache_manifests(run, name, namespace, labels, config_map, secret_env)
        env.update(cache_endpoints(run, name, namespace))
    trainer: dict[str, Any] = {
        "image": lc["image"],
        "command": ["torchrun", f"--max-restarts={rt['max_restarts']}",
                    *worker_command(f"{CONFIG_DIR}/config.yaml")],
        "numNodes": int(rt["nnodes"]),
        "numProcPerNode": run.world_size // int(rt["nnodes"]),
        "env": [{"name": k, "value": v} for k, v in env.items()] + secret_env,
    }
    resources = _resources(lc.get("resources_per_node") or {})
    if resources:
        trainer["resourcesPerNode"] = resources
    spec: dict[str, Any] = {
        "runtimeRef": ref,
        "trainer": trainer,
        "runtimePatches": [{"manager": f"{MANAGER}.dev/launcher", "trainingRuntimeSpec": {"template": {"spec": {
            "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
                "spec": _pod_patch(lc, config_map)}}}}]}}}}],
    }
    if lc.get("suspend"):
        spec["suspend"] = True
    if lc.get("active_deadline_seconds"):
        spec["activeDeadlineSeconds"] = int(lc["active_deadline_seconds"])
    trainjob = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJob",
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)}, "spec": spec}
    schedulers.apply_to_trainjob(sc, trainjob)
    manifests.append(trainjob)
    return manifests


def cache_endpoints(run: Run, name: str, namespace: str) -> dict[str, str]:
    """The ranks' environment naming the cache pods by their stable DNS names (`<pod>.<service>`)."""
    nodes, service = run.cache_nodes, f"{name}-cache"
    pods = [f"{service}-{i}.{service}.{namespace}.svc" for i in range(nodes.count)]
    return nodes.env([f"grpc://{p}:{nodes.port}" for p in pods], [f"grpc://{pods[0]}:{nodes.eval_port}"])


def cache_manifests(run: Run, name: str, namespace: str, labels: dict[str, str], config_map: str,
                    secret_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A headless Service and a StatefulSet of `data.cache.nodes` pods, pod i serving shard i of the
    training rows (the index from the pod's `apps.kubernetes.io/pod-index` label), ready once `python -m
    datacache ready` answers inside it; the same image, config and volumes as the ranks."""
    lc, nodes, service = run.config["launcher"], run.cache_nodes, f"{name}-cache"
    selector = {"trainjob.dev/cache": name}
    pod = _pod_patch(lc, config_map)
    mounts = pod.pop("containers")[0]["volumeMounts"]
    index = {"name": "POD_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}
    container = {
        "name": "cache", "image": lc["image"],
        "command": ["python", *nodes.argv(f"{CONFIG_DIR}/config.yaml", "$(POD_INDEX)", "0.0.0.0", nodes.port,
                                          nodes.eval_port)],
        "env": [index, {"name": "PYTHONUNBUFFERED", "value": "1"}, *secret_env],
        "ports": [{"name": "train", "containerPort": nodes.port}, {"name": "eval", "containerPort": nodes.eval_port}],
        "readinessProbe": {"exec": {"command": ["python", "-m", "datacache", "ready",
                                                f"grpc://127.0.0.1:{nodes.port}"]},
                           "periodSeconds": 5, "timeoutSeconds": 30},
        "volumeMounts": mounts,
    }
    return [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": service, "namespace": namespace, "labels": labels},
         "spec": {"clusterIP": "None", "selector": selector,
                  "ports": [{"name": "train", "port": nodes.port}, {"name": "eval", "port": nodes.eval_port}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet",
         "metadata": {"name": service, "namespace": namespace, "labels": labels},
         "spec": {"serviceName": service, "replicas": nodes.count, "podManagementPolicy": "Parallel",
                  "selector": {"matchLabels": selector},
                  "template": {"metadata": {"labels": {**labels, **selector}},
                               "spec": {**pod, "containers": [container]}}}},
    ]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config in the ConfigMap) as literal blocks, readable in `kubectl get -o yaml`."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                             style="|" if "\n" in s else None))


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
        msg = (f"cannot {what}: not found; is Kubeflow Trainer v2 installed, and does the "
               f"ClusterTrainingRuntime exist (kubectl get clustertrainingruntimes)?")
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

    def __init__(self, lc: dict[str, Any]):
        from kubernetes import client, config

        try:
            if lc.get("kubeconfig") or os.environ.get("KUBECONFIG") or os.path.exists(
                    os.path.expanduser("~/.kube/config")):
                api_client = config.new_client_from_config(config_file=lc.get("kubeconfig"),
                                                           context=lc.get("context"))
            else:
                config.load_incluster_config()
                api_client = client.ApiClient()
        except config.ConfigException as e:
            raise LauncherError(f"no usable Kubernetes config (launcher.kubeconfig={lc.get('kubeconfig')!r}, "
                                f"launcher.context={lc.get('context')!r}): {e}") from None
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
            raise LauncherError(f"Kubernetes API: cannot reach the API server at {self.host} to {verb} {kind} "
                                f"{name!r}: {reason}") from None


def _plural(kind: str) -> str:
    return {"TrainJob": "trainjobs", "TrainingRuntime": "trainingruntimes"}[kind]


class KubernetesJob(PollingJob):
    def __init__(self, api: Api, run: Run | None, name: str, namespace: str, poll_seconds: float = 10.0):
        self.api, self.run, self.name, self.namespace, self.poll_seconds = api, run, name, namespace, poll_seconds
        self._cancelled = False

    def _get(self) -> dict[str, Any]:
        return self.api.call("get", "TrainJob", self.name, self.namespace,
                             self.api.custom.get_namespaced_custom_object, GROUP, VERSION, self.namespace,
                             "trainjobs", self.name)

    def _pods(self, node: int | None = None) -> list:
        selector = f"jobset.sigs.k8s.io/jobset-name={self.name}"
        if node is not None:
            selector += f",jobset.sigs.k8s.io/job-index={node}"
        pods = self.api.call("list", "Pod", selector, self.namespace, self.api.core.list_namespaced_pod,
                             self.namespace, label_selector=selector)
        return list(pods.items)

    def status(self) -> JobState:
        if self._cancelled:
            return JobState.CANCELLED
        conditions = {c["type"]: c.get("status") for c in (self._get().get("status") or {}).get("conditions", [])}
        if conditions.get("Complete") == "True":
            return JobState.SUCCEEDED
        if conditions.get("Failed") == "True":
            return JobState.FAILED
        if conditions.get("Suspended") == "True":
            return JobState.PENDING
        # No Running condition exists: a job runs once one of its pods does.
        phases = {p.status.phase for p in self._pods()}
        return JobState.RUNNING if phases & {"Running", "Succeeded"} else JobState.PENDING

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        """Lines of node `rank`'s pod (`<job>-node-<rank>-...`, container `node`)."""
        pods = self._pods(rank)
        if not pods:
            raise LauncherError(f"TrainJob {self.name!r} has no pod for node {rank} (yet)")
        pod = pods[0].metadata.name
        stream = self.api.call("read logs of", "Pod", pod, self.namespace, self.api.core.read_namespaced_pod_log,
                               pod, self.namespace, container="node", follow=follow, _preload_content=False)
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
        self.api.call("delete", "TrainJob", self.name, self.namespace,
                      self.api.custom.delete_namespaced_custom_object, GROUP, VERSION, self.namespace,
                      "trainjobs", self.name, propagation_policy="Foreground")
        self._cancelled = True

    def result(self) -> dict[str, Any] | None:
        local_root = self.run.config["launcher"].get("local_run_root") if self.run else None
        return read_summary(os.path.join(local_root, self.name)) if local_root else None


def attach(name: str, namespace: str = "default", kubeconfig: str | None = None,
           context: str | None = None) -> KubernetesJob:
    """A handle on a TrainJob submitted earlier (status, logs, wait, cancel)."""
    return KubernetesJob(Api({"kubeconfig": kubeconfig, "context": context}), None, name, namespace)


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
    return api.call("create", kind, name, namespace, api.custom.create_namespaced_custom_object, GROUP, VERSION,
                    namespace, _plural(kind), m)


CACHE_READY_TIMEOUT = 1800.0  # each cache pod builds the corpus before it serves


def _wait_for_cache(api: Api, name: str, namespace: str, count: int, poll_seconds: float) -> None:
    """Until the cache StatefulSet's pods are all ready (their `python -m datacache ready` probe answers)."""
    deadline = time.monotonic() + CACHE_READY_TIMEOUT
    while True:
        status = api.call("read", "StatefulSet", name, namespace, api.apps.read_namespaced_stateful_set_status,
                          name, namespace).status
        if (status.ready_replicas or 0) >= count:
            return
        if time.monotonic() > deadline:
            raise LauncherError(f"the {count} cache pods of StatefulSet {name!r} are not ready after "
                                f"{CACHE_READY_TIMEOUT:.0f} s (kubectl describe statefulset {name} -n {namespace})")
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
        api.call("patch", kind, name, namespace, api.custom.patch_namespaced_custom_object, GROUP, VERSION,
                 namespace, _plural(kind), name, patch)


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
            api.call("delete", kind, name, namespace, api.custom.delete_namespaced_custom_object, GROUP, VERSION,
                     namespace, _plural(kind), name)
    except LauncherError:
        pass


class KubernetesLauncher(Launcher):
    def __init__(self, lc: dict[str, Any] | None = None):
        self._lc = lc

    def launch(self, run: Run) -> Job | None:
        lc = run.config["launcher"]
        if lc.get("dry_run"):
            sys.stdout.write(to_yaml(render(run)))
            sys.stdout.flush()
            return None
        api = Api(lc)
        namespace, name = lc["namespace"], job_name(run)
        runtime_spec = None
        if run.config["scheduler"]["name"] in schedulers.NEEDS_RUNTIME:
            ref = lc.get("runtime_ref") or run.config["runtime"]["name"]
            runtime_spec = api.call("get", "ClusterTrainingRuntime", ref, namespace,
                                    api.custom.get_cluster_custom_object, GROUP, VERSION,
                                    "clustertrainingruntimes", ref)["spec"]
        created: list[dict[str, Any]] = []
        try:
            for m in render(run, runtime_spec, reveal=True):
                if m["kind"] == "TrainJob" and run.cache_nodes:
                    _wait_for_cache(api, f"{name}-cache", namespace, run.cache_nodes.count,
                                    float(lc.get("poll_seconds", 10.0)))
                trainjob = _create(api, m, namespace)  # the TrainJob comes last
                created.append(m)
            owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJob", "name": name,
                     "uid": trainjob["metadata"]["uid"], "blockOwnerDeletion": True}
            for m in created[:-1]:
                _own(api, m, namespace, owner)
        except LauncherError:
            # Nothing half-submitted: remove what this launch created, newest first.
            for m in reversed(created):
                _delete(api, m, namespace)
            raise
        write_private(os.path.join(run.run_dir, "manifests.yaml"), to_yaml(render(run, runtime_spec)))
        return KubernetesJob(api, run, name, namespace, float(lc.get("poll_seconds", 10.0)))

    def list_jobs(self) -> list[Job]:
        """The TrainJobs this launcher submitted in the configured namespace."""
        lc = self._lc or {}
        api, namespace = Api(lc), lc.get("namespace", "default")
        found = api.call("list", "TrainJob", "*", namespace, api.custom.list_namespaced_custom_object, GROUP,
                         VERSION, namespace, "trainjobs", label_selector=f"app.kubernetes.io/managed-by={MANAGER}")
        return [KubernetesJob(api, None, item["metadata"]["name"], namespace) for item in found.get("items", [])]


def make(config: dict[str, Any]) -> KubernetesLauncher:
    return KubernetesLauncher(config)
