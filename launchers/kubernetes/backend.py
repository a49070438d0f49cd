"""The Kubernetes launcher: a run becomes a Kubeflow Trainer v2 TrainJob (`trainer.kubeflow.org/v1alpha1`).

Every node runs `torchrun ... -m trainer.worker /etc/trainjob/config.yaml`; torchrun takes the node count,
processes per node, node rank and master address from the `PET_*` variables that Trainer's torch plugin
injects. The resolved config travels in a ConfigMap mounted into container `node`, and is owned by the
TrainJob so that deleting the job deletes it; the run's secrets (the data cache token) travel in a
Secret, owned the same way, that the pods read through `secretKeyRef`. Data cache nodes
(`data.cache.nodes`) are a StatefulSet behind a headless Service, owned the same way; the TrainJob is
created once their pods are ready. Gang schedulers
(`launchers.kubernetes.schedulers`) add labels, or a namespaced TrainingRuntime derived from the cluster's.
`launcher.dry_run=true` prints the manifests as multi-document YAML for `kubectl apply -f -` (secret
values masked) and submits nothing. A submission that fails removes whatever it had created, and only a
submitted job leaves `<run_dir>/manifests.yaml` (mode 0600, secret values masked).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from launchers import base
from launchers.backend import Backend, runtime_unit
from launchers.base import JobInfo, JobState, LauncherError, LaunchSpec, run_name, write_private
from launchers.kubernetes import schedulers
from launchers.kubernetes.manifests import GROUP, MANAGER, VERSION, cluster_runtime, manifests, to_yaml
from launchers.kubernetes.options import KubernetesLauncherConfig, check
from trainjob.run_files import RunDir, read_progress
from trainjob.runtimes import UNKNOWN, Runtime

__all__ = ["KubernetesLauncher", "KubernetesLauncherConfig", "check", "make"]


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


# A pod's phase as a step's state, and the JobSet labels that say which replicated job and index a pod is.
PHASES = {"Pending": JobState.CREATED, "Running": JobState.RUNNING, "Succeeded": JobState.COMPLETE,
          "Failed": JobState.FAILED}
REPLICATED_JOB, JOB_INDEX = "jobset.sigs.k8s.io/replicatedjob-name", "jobset.sigs.k8s.io/job-index"


def pod_steps(pods: list) -> dict[str, Any]:
    """Each step's pod, as Kubeflow's SDK names them (get_trainjob_node_step): the launcher pod of an MPI job is
    node-0 and its node pod i node-<i+1>; another job's node pod i is node-<i>. Initializers are no steps."""
    mpi_run = any((p.metadata.labels or {}).get(REPLICATED_JOB) == "launcher" for p in pods)
    steps: dict[str, Any] = {}
    for pod in pods:
        labels = pod.metadata.labels or {}
        role = labels.get(REPLICATED_JOB, "node")
        if role in ("launcher", "node"):
            index = 0 if role == "launcher" else int(labels.get(JOB_INDEX, 0)) + mpi_run
            steps.setdefault(f"node-{index}", pod)
    return dict(sorted(steps.items(), key=lambda item: int(item[0][5:])))


# The resource limits Kubeflow's SDK reads a device from, in its order (get_container_devices), and the device each
# names; nvidia.com/mig-<profile> names mig-<profile>.
DEVICE_LIMITS = (("nvidia.com/gpu", "gpu"), ("google.com/tpu", "tpu"), ("nvidia.com/mig-", None),
                 ("huawei.com/Ascend910", "npu"), ("cpu", "cpu"))


def pod_device(pod: Any) -> tuple[str, str]:
    """A step's device and device count as Kubeflow's SDK reads them from its pod (get_trainjob_node_step): the first
    of DEVICE_LIMITS among the limits of its container `node`, with that limit as the count; a numeric
    PET_NPROC_PER_NODE in that container's environment is the count (torch's processes per node), with or without
    such a limit. The device is Unknown where its limits name none of them (where the SDK raises)."""
    node = next((c for c in (pod.spec.containers if pod.spec else None) or [] if c.name == "node"), None)
    if node is None:
        return UNKNOWN, UNKNOWN
    device = count = UNKNOWN
    limits = (node.resources.limits if node.resources else None) or {}
    for key, name in DEVICE_LIMITS:
        found = sorted(k for k in limits if k == key or (name is None and k.startswith(key)))
        if found:
            device, count = name or found[0].split("/")[1], str(limits[found[0]])
            break
    for env in node.env or []:
        if env.name == "PET_NPROC_PER_NODE" and env.value and env.value.isdigit():
            count = env.value
    return device, count


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


class KubernetesJob(base.PollingJob):
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
        pods = self.api.call("list", "Pod", selector, self.namespace, self.api.core.list_namespaced_pod,
                             self.namespace, label_selector=selector)
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
            steps=[base.Step(name, PHASES.get(pod.status.phase, JobState.CREATED), pod.metadata.name, *pod_device(pod))
                   for name, pod in pod_steps(self._pods()).items()],
        )

    def step_logs(self, step: str, follow: bool = False) -> Iterator[str]:
        """Lines of step `step`'s pod (container `node`; an MPI job's node-0: its launcher, with every rank's)."""
        steps = pod_steps(self._pods())
        base.check_step(step, list(steps), self.name)
        return self._pod_logs(steps[step].metadata.name, follow)

    def logs(self, rank: int = 0, follow: bool = False) -> Iterator[str]:
        """Lines of node `rank`'s pod (`<job>-node-<rank>-...`, container `node`)."""
        pods = self._pods(rank)
        if not pods:
            raise LauncherError(f"TrainJob {self.name!r} has no pod for node {rank} (yet)")
        return self._pod_logs(pods[0].metadata.name, follow)

    def _pod_logs(self, pod: str, follow: bool) -> Iterator[str]:
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


def print_packages() -> None:
    """What a runtime's environment holds (the SDK's print_packages): run in it by `get_runtime_packages`."""
    import shutil
    import subprocess
    import sys

    print(f"Python: {sys.version}")
    if shutil.which("pip"):
        subprocess.run(["pip", "list"], check=False)
    else:
        subprocess.run([sys.executable, "-m", "pip", "list"], check=False)
    if shutil.which("nvidia-smi"):
        print("Available GPUs on the single training node")
        subprocess.run(["nvidia-smi"], check=False)


class KubernetesLauncher(Backend):
    name = "kubernetes"

    def __init__(self, options: Mapping[str, Any], scheduler: Mapping[str, Any] | None = None):
        self.options = dict(options)
        self.scheduler = dict(scheduler or {"name": "none"})
        self._api: Api | None = None

    def needs_image(self, unit: Runtime) -> bool:
        return unit.derives_runtime  # else the shipped runtime's image, as the SDK runs it

    def for_function_job(self, job: Any) -> KubernetesLauncher:
        """This launcher, or where the job has resources per node of its own, one whose nodes request them."""
        if not job.resources_per_node:
            return self
        res = {"cpu": None, "memory": None, "gpu": 0, **(self.given.get("resources_per_node") or {})}
        res.update({k: (int(v) if k == "gpu" else str(v)) for k, v in job.resources_per_node.items()})
        return KubernetesLauncher({**self.options, "resources_per_node": res})

    def runtime_image(self, unit: Runtime) -> str:
        # A derived runtime runs the job's image; the shipped one's, its own where none is given.
        return self.options.get("image") or unit.kubeflow_image

    def device(self) -> tuple[str, str]:
        res = self.options.get("resources_per_node") or {}
        if res.get("gpu"):
            return "gpu", str(res["gpu"])
        return ("cpu", str(res["cpu"])) if res.get("cpu") else (UNKNOWN, UNKNOWN)

    def get_runtime_packages(self, name: str) -> str:
        """A one-node job of the runtime that prints them, waited for, its log returned, then deleted, as
        Kubeflow's SDK does."""
        unit = runtime_unit(name)
        job = self.train(func=print_packages, runtime=name, num_nodes=1,
                         resources_per_node=None if unit.function_only else {"cpu": 1})
        try:
            self.wait_for_job_status(job, timeout=600)
            return "\n".join(self.get_job_logs(job)) + "\n"
        finally:
            self.delete_job(job)

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
        """The manifests as multi-document YAML for `kubectl apply -f -`, secret values masked, under comment
        lines saying which failure policies apply."""
        manifests = self.manifests(spec)  # refuses what cannot run first
        restarts = None if cluster_runtime(spec, self.options) is None else spec.runtime.options.get("max_restarts", 0)
        lines = schedulers.policies_text(restarts)
        if not any(m["kind"] == "TrainingRuntime" for m in manifests) and self.options.get("runtime_ref"):
            lines = [f"failure policies, initializers and pod group: the ClusterTrainingRuntime "
                     f"{self.options['runtime_ref']}'s own (python -m launchers.kubernetes.cluster_runtimes prints "
                     "trainjob's)"]
        return "".join(f"# {line}\n" for line in lines) + to_yaml(manifests)

    def _job(self, name: str) -> KubernetesJob:
        return KubernetesJob(
            self.api,
            name,
            self.options.get("namespace", "default"),
            float(self.options.get("poll_seconds", 10.0)),
            self.options.get("local_run_root"),
        )

    def launch(self, spec: LaunchSpec) -> base.Job:
        lc, api = self.options, self.api
        namespace, name = lc["namespace"], self.job_name(spec)
        runtime_spec = None
        ref = cluster_runtime(spec, lc)
        if ref is not None:  # the cluster's runtime, which the job's own is derived from
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
        write_private(RunDir.of(spec.run_dir).manifests, to_yaml(self.manifests(spec, runtime_spec)))
        return self._job(name)

    def jobs(self) -> list[base.Job]:
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

    def job(self, name: str) -> base.Job:
        job = self._job(name)
        job._get()  # a clear error when there is none
        return job


def make(options: Mapping[str, Any], scheduler: Mapping[str, Any] | None = None) -> KubernetesLauncher:
    return KubernetesLauncher(options, scheduler)
