"""The Kubernetes launcher, laid out as Kubeflow's SDK lays out a backend: `options` (the schema and its
checks), `schedulers` (the gang schedulers: their schema, checks and what each adds to a TrainJob),
`manifests` (what a run becomes: a TrainJob, its ConfigMap, Secret and cache nodes) and `backend` (the API
calls: submit, watch, cancel). See `launchers.kubernetes.backend` for how a run is submitted.

Its names load on first use, so that reading the options' schema (the driver composing a config) loads neither
the manifests nor the kubernetes client."""

from __future__ import annotations

from trainjob import lazy

_HOMES = {"KubernetesLauncherConfig": "launchers.kubernetes.options", "check": "launchers.kubernetes.options",
          "make": "launchers.kubernetes.backend"}

__all__ = sorted(_HOMES)

__getattr__ = lazy.names(__name__, _HOMES)
