"""Gang schedulers for the Kubernetes launcher: what each one adds to a TrainJob, and the namespaced
TrainingRuntime every job runs on, derived from the cluster's: it carries the failure policies whatever the
scheduler (`add_failure_policies`), and the pod group or scheduler name of those that need one.

- kueue: label `kueue.x-k8s.io/queue-name` (and `kueue.x-k8s.io/priority-class`), created suspended;
  Kueue admits the job by unsuspending it.
- volcano: `podGroupPolicy.volcano` on the runtime; queue annotation `scheduling.volcano.sh/queue-name`.
- coscheduling: `podGroupPolicy.coscheduling.scheduleTimeoutSeconds` on the runtime.
- kai: pods with `schedulerName: kai-scheduler` and label `kai.scheduler/queue` (a runtime patch cannot
  set a scheduler name, so it goes into the derived runtime).

`SchedulerConfig` is the `scheduler` group's schema; `check` holds its rules.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from launchers.base import require

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
SCHEDULERS = ("none", "kueue", "volcano", "coscheduling", "kai")
NEEDS_RUNTIME = ("volcano", "coscheduling", "kai")  # a pod group or a scheduler name: in the derived runtime


@dataclass
class SchedulerConfig:
    name: str = MISSING  # the option chosen: none, kueue, volcano, coscheduling or kai
    queue: str | None = None  # the scheduler's queue the job is submitted to (Kueue's LocalQueue, Volcano's queue)
    priority_class: str | None = None  # the pods' PriorityClass
    # Seconds the gang waits for all its pods to be placed before it is given up (null: the scheduler's default).
    schedule_timeout_seconds: int | None = None


def check(sc: Mapping[str, Any], launcher: str) -> None:
    """The scheduler's rules, for a job on `launcher`; raises OptionError."""
    require(sc["name"] in SCHEDULERS, "scheduler.name", sc["name"], f"must be one of {', '.join(SCHEDULERS)}")
    if sc["name"] != "none":
        require(
            launcher == "kubernetes",
            "scheduler",
            sc["name"],
            f"gang schedulers run on Kubernetes: use launcher=kubernetes (launcher is {launcher})",
        )
    if sc["name"] in ("kueue", "kai"):
        require(
            bool(sc.get("queue")),
            "scheduler.queue",
            sc.get("queue"),
            f"scheduler={sc['name']} needs the queue to submit to",
        )
    timeout = sc.get("schedule_timeout_seconds")
    require(timeout is None or timeout > 0, "scheduler.schedule_timeout_seconds", timeout, "must be > 0, or null")


ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"


def builtin_torch_runtime(image: str) -> dict[str, Any]:
    """The spec of Kubeflow Trainer's `torch-distributed` ClusterTrainingRuntime, for when the cluster's
    own cannot be read (a dry run)."""
    return {
        "mlPolicy": {"numNodes": 1, "torch": {}},
        "template": {
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "node",
                        "template": {
                            "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                            "spec": {"template": {"spec": {"containers": [{"name": "node", "image": image}]}}},
                        },
                    }
                ]
            }
        },
    }


def builtin_mpi_runtime(image: str, ssh_port: int = 2222) -> dict[str, Any]:
    """The spec of Kubeflow Trainer's `deepspeed-distributed` ClusterTrainingRuntime (its MPI runtime), for when
    the cluster's own cannot be read (a dry run): `node` pods run sshd on 2222, the `launcher` pod (the trainer)
    runs mpirun once the nodes are ready; the launcher is a host too."""
    node = {"name": "node", "image": image, "command": ["/usr/sbin/sshd"], "args": ["-De", "-p", str(ssh_port)],
            "readinessProbe": {"tcpSocket": {"port": ssh_port}, "initialDelaySeconds": 5}}
    return {
        "mlPolicy": {"numNodes": 1, "mpi": {"numProcPerNode": 1, "mpiImplementation": "OpenMPI",
                                            "sshAuthMountPath": "/root/.ssh", "runLauncherAsNode": True}},
        "template": {"spec": {
            "network": {"publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["launcher"]},
            "replicatedJobs": [
                {"name": "node", "template": {"spec": {"template": {"spec": {"containers": [node]}}}}},
                {"name": "launcher", "dependsOn": [{"name": "node", "status": "Ready"}], "template": {
                    "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                    "spec": {"template": {"spec": {"containers": [{"name": "node", "image": image}]}}}}},
            ],
        }},
    }


def _pod_templates(spec: dict[str, Any]):
    for job in spec["template"]["spec"]["replicatedJobs"]:
        yield job["template"]["spec"]["template"]


# The exit code of a rank that refused its config or inputs (trainer.worker), passed on by torchrun's agent.
REFUSED_EXIT_CODE = 2


def policies_text(max_restarts: int | None) -> list[str]:
    """What the failure policies of a job do, a line each, for the dry run (None: the job has none of ours)."""
    if max_restarts is None:
        return ["failure policies: the cluster runtime's own (data.cache.backend=kubeflow runs on it); "
                "runtime.max_restarts must be 0 there"]
    return ["failure policies (the derived TrainingRuntime):",
            f"  exit {REFUSED_EXIT_CODE} (a refused config or input) fails the job at once: podFailurePolicy FailJob, "
            "JobSet FailJobSet",
            "  a pod evicted or preempted (DisruptionTarget) is replaced and does not count as a failure",
            f"  any other failure restarts the JobSet up to runtime.max_restarts={max_restarts} times "
            "(failurePolicy.maxRestarts; torchrun in the pod restarts nothing)",
            "  the job succeeds when node 0 does (successPolicy)"]


def add_failure_policies(spec: dict[str, Any], max_restarts: int, container: str = "node") -> None:
    """The JobSet's failure and success policies, in place on a runtime's `spec`:
    - a node whose ranks refused the config or its inputs (exit 2) fails its Job at once (`podFailurePolicy`
      FailJob), and that failure fails the JobSet instead of restarting it: a refusal cannot heal;
    - a pod evicted or preempted (condition DisruptionTarget) is replaced without counting as a failure;
    - any other failure restarts the JobSet up to `max_restarts` times (`runtime.max_restarts`), the run
      resuming from its newest checkpoint on the shared claim;
    - the trainer's Job succeeds when its pod 0 succeeds (its index 0), and the JobSet when that Job does.
    The trainer's Job is the one Kubeflow labels as the trainer (`node` under torch, MPI's `launcher`)."""
    template = spec["template"]["spec"]
    labelled = [job for job in template["replicatedJobs"]
                if job["template"].get("metadata", {}).get("labels", {}).get(ANCESTOR_LABEL) == "trainer"]
    nodes = labelled or [job for job in template["replicatedJobs"] if job["name"] == "node"]
    names = [job["name"] for job in nodes]
    template["failurePolicy"] = {
        "maxRestarts": max_restarts,
        "rules": [{"name": "RefusedConfig", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
                   "targetReplicatedJobs": names}],
    }
    template["successPolicy"] = {"operator": "All", "targetReplicatedJobs": names}
    for job in nodes:
        job_spec = job["template"].setdefault("spec", {})
        job_spec["completionMode"] = "Indexed"  # what successPolicy's indexes need (JobSet's default too)
        job_spec["podFailurePolicy"] = {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In",
                                                  "values": [REFUSED_EXIT_CODE]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]}
        job_spec["successPolicy"] = {"rules": [{"succeededIndexes": "0"}]}
        # A Job's podFailurePolicy needs pods that are never restarted in place.
        job_spec.setdefault("template", {}).setdefault("spec", {})["restartPolicy"] = "Never"


def derived_runtime(
    scheduler: dict[str, Any], base_spec: dict[str, Any], name: str, namespace: str, labels: dict[str, str],
    max_restarts: int = 0, framework: str = "torch", ml_policy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A namespaced TrainingRuntime: `base_spec` (the cluster runtime's spec) plus the gang policy and the
    failure policies (`add_failure_policies`), labelled with the runtime's `framework`; `ml_policy` (the
    job's runtime's own settings, such as mlPolicy.mpi's) merged over the base's."""
    spec = copy.deepcopy(base_spec)
    for key, value in (ml_policy or {}).items():
        policy = spec.setdefault("mlPolicy", {})
        policy[key] = {**policy.get(key, {}), **value} if isinstance(value, dict) else value
    add_failure_policies(spec, max_restarts)
    kind = scheduler["name"]
    if kind == "volcano":
        spec["podGroupPolicy"] = {"volcano": {}}
    elif kind == "coscheduling":
        timeout = scheduler.get("schedule_timeout_seconds")
        spec["podGroupPolicy"] = {"coscheduling": {"scheduleTimeoutSeconds": timeout} if timeout else {}}
    for template in _pod_templates(spec):
        pod = template.setdefault("spec", {})
        if kind == "kai":
            pod["schedulerName"] = "kai-scheduler"
            template.setdefault("metadata", {}).setdefault("labels", {})["kai.scheduler/queue"] = scheduler["queue"]
        if scheduler.get("priority_class") and kind in ("volcano", "kai"):
            pod["priorityClassName"] = scheduler["priority_class"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingRuntime",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**labels, "trainer.kubeflow.org/framework": framework},
        },
        "spec": spec,
    }


def apply_to_trainjob(scheduler: dict[str, Any], trainjob: dict[str, Any]) -> None:
    """Add the scheduler's labels, annotations and suspension to `trainjob` in place."""
    kind = scheduler["name"]
    meta = trainjob["metadata"]
    if kind == "kueue":
        meta.setdefault("labels", {})["kueue.x-k8s.io/queue-name"] = scheduler["queue"]
        if scheduler.get("priority_class"):
            meta["labels"]["kueue.x-k8s.io/priority-class"] = scheduler["priority_class"]
        trainjob["spec"]["suspend"] = True
    elif kind == "volcano" and scheduler.get("queue"):
        meta.setdefault("annotations", {})["scheduling.volcano.sh/queue-name"] = scheduler["queue"]
    elif kind == "kai":
        meta.setdefault("labels", {})["kai.scheduler/queue"] = scheduler["queue"]
