"""The Kubernetes launcher, laid out as Kubeflow's SDK lays out a backend: `options` (the schema and its
checks), `manifests` (what a run becomes: a TrainJob, its ConfigMap, Secret and cache nodes) and `backend`
(the API calls: submit, watch, cancel). See `launchers.kubernetes.backend` for how a run is submitted."""

from launchers.kubernetes.backend import KubernetesLauncherConfig, check, make

__all__ = ["KubernetesLauncherConfig", "check", "make"]
