"""Validation of manifests against the real Kubeflow Trainer v2.3.0 and JobSet v0.12.0 CRD schemas.

The schemas are read from $TRAINJOB_CRDS, by default `../shared/reference/kubeflow-trainer-v2.3.0/crds`
beside the repository. They are made strict first: a field that the schema does not name is an error
(as with `kubectl apply`'s strict field validation), unless the schema preserves unknown fields. The
CEL rules on metadata.name (RFC 1035, at most 63 characters) are checked as well.
"""

from __future__ import annotations

import copy
import functools
import os
import re

import jsonschema
import pytest
import yaml

from tests.conftest import REPO

DEFAULT_DIR = os.path.join(os.path.dirname(REPO), "shared", "reference", "kubeflow-trainer-v2.3.0", "crds")
FILES = {
    "TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
    "TrainingRuntime": "trainer.kubeflow.org_trainingruntimes.yaml",
    "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    "JobSet": "jobset.x-k8s.io_jobsets.v0.12.0.yaml",
}


def crd_dir() -> str:
    path = os.environ.get("TRAINJOB_CRDS", DEFAULT_DIR)
    if not all(os.path.isfile(os.path.join(path, f)) for f in FILES.values()):
        pytest.skip(
            f"the Kubeflow Trainer CRD schemas are absent from {path}: set TRAINJOB_CRDS to the folder "
            f"holding {', '.join(FILES.values())}"
        )
    return path


def _strict(schema):
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    return schema


@functools.cache
def schema(kind: str) -> dict:
    with open(os.path.join(crd_dir(), FILES[kind])) as f:
        crd = yaml.safe_load(f)
    version = next(v for v in crd["spec"]["versions"] if v.get("storage", True))
    openapi = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    # metadata is `type: object` in a CRD; apiVersion and kind are checked by the API server itself.
    return _strict(openapi)


NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def validate(manifest: dict) -> None:
    """Raise jsonschema.ValidationError (or AssertionError for the CEL name rules) when invalid."""
    kind = manifest["kind"]
    jsonschema.validate(manifest, schema(kind), cls=jsonschema.Draft7Validator)
    name = manifest["metadata"]["name"]
    assert NAME.match(name) and len(name) <= 63, f"metadata.name {name!r} breaks the RFC 1035 rule"
    if kind in ("TrainingRuntime", "ClusterTrainingRuntime"):
        # The runtime's template is a JobSet template: its spec must be a valid JobSet spec.
        jobset = schema("JobSet")["properties"]["spec"]
        jsonschema.validate(manifest["spec"]["template"]["spec"], jobset, cls=jsonschema.Draft7Validator)
