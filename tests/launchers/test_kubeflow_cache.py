"""`data.cache.backend=kubeflow`: the TrainJob runs on Kubeflow Trainer's `torch-distributed-with-cache`
runtime with its dataset initializer (the table, its metadata, the data nodes and their resources), valid
against the real CRDs, and the ranks read the cache's head through StreamingDataset; the run's own
StatefulSet (`backend=trainjob`, the default) is not made. Bad settings are refused naming the key.
"""

from __future__ import annotations

import os

import pytest
import yaml
from omegaconf import OmegaConf

from launchers import LauncherError
from launchers import get as get_launcher
from tests.conftest import compose_run
from tests.launchers import crds
from trainer import config
from trainer.config.compose import compose
from trainer.config.validate import validate

KUBEFLOW = ["data.cache.backend=kubeflow", "data.cache.nodes=4", "data.cache.kubeflow.storage_uri=cache://shop/reviews",
            "data.cache.kubeflow.metadata_loc=s3a://bucket/reviews/metadata.json",
            "data.cache.kubeflow.iam_role=arn:aws:iam::1:role/cache", "data.cache.kubeflow.worker_mem=8Gi"]


def _run(tmp_path, *overrides):
    run = compose_run(tmp_path, "launcher=kubernetes", "+runtime=torch-distributed", "launcher.namespace=ml",
                      *overrides)
    launcher = get_launcher(run.launcher, run.scheduler)
    return run, launcher


def test_the_trainjob_runs_on_the_cache_runtime_with_its_dataset_initializer(tmp_path, monkeypatch):
    run, launcher = _run(tmp_path, *KUBEFLOW)
    docs = launcher.manifests(run.spec)
    assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob"]  # no StatefulSet or Service of ours
    job = docs[-1]
    crds.validate(job)
    assert job["spec"]["runtimeRef"] == {"kind": "ClusterTrainingRuntime", "name": "torch-distributed-with-cache"}
    assert job["spec"]["initializer"] == {"dataset": {"storageUri": "cache://shop/reviews", "env": [
        {"name": "CLUSTER_SIZE", "value": "4"},
        {"name": "METADATA_LOC", "value": "s3a://bucket/reviews/metadata.json"},
        {"name": "IAM_ROLE", "value": "arn:aws:iam::1:role/cache"},
        {"name": "HEAD_CPU", "value": "1"}, {"name": "HEAD_MEM", "value": "1Gi"},
        {"name": "WORKER_CPU", "value": "2"}, {"name": "WORKER_MEM", "value": "8Gi"}]}}
    name = job["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in job["spec"]["trainer"]["env"]}
    head = f"kubeflow+grpc://{name}-cache-service.ml.svc:50051"
    assert env["TRAINJOB_CACHE_ENDPOINTS"] == f"[{head}]"
    # the runtime patch names the runtime's trainer job ("node"), as the cache runtime has it
    with open(os.path.join(os.path.dirname(crds.DEFAULT_DIR), "runtimes",
                           "data-cache__torch_distributed_with_cache.yaml")) as f:
        runtime = yaml.safe_load(f)
    crds.validate(runtime)
    jobs = {j["name"] for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    patched = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert {j["name"] for j in patched} <= jobs and "dataset-initializer" in jobs
    # each rank reads the head from the config the pod gets, eval rows from its own corpus
    saved = OmegaConf.create(yaml.safe_load(docs[0]["data"]["config.yaml"]))
    monkeypatch.setenv("TRAINJOB_CACHE_ENDPOINTS", env["TRAINJOB_CACHE_ENDPOINTS"])
    assert list(saved.data.cache.endpoints) == [head] and list(saved.data.cache.eval_endpoints) == []
    config.CacheConfig(endpoints=[head]).check()  # a Flight endpoint the schema takes


def test_the_default_backend_keeps_our_statefulset(tmp_path):
    run, launcher = _run(tmp_path, "data.cache.nodes=2")
    assert [d["kind"] for d in launcher.manifests(run.spec)] == ["TrainingRuntime", "ConfigMap", "Service",
                                                                 "StatefulSet", "TrainJob"]


def test_a_gang_scheduler_that_derives_its_own_runtime_is_refused(tmp_path):
    run, launcher = _run(tmp_path, *KUBEFLOW, "scheduler=volcano")
    with pytest.raises(LauncherError, match="data.cache.backend=kubeflow runs on the torch-distributed-with-cache "
                                            "runtime, and scheduler=volcano would derive a runtime of its own"):
        launcher.manifests(run.spec)


@pytest.mark.parametrize(("overrides", "message"), [
    (["launcher=kubernetes", "+runtime=torch-distributed", *KUBEFLOW[:1], *KUBEFLOW[2:]],
     "data.cache.nodes=0: must be >= 1 with data.cache.backend=kubeflow"),
    (["launcher=kubernetes", "+runtime=torch-distributed", *KUBEFLOW, "data.cache.kubeflow.storage_uri=s3://b/t"],
     "data.cache.kubeflow.storage_uri='s3://b/t': must be cache://<schema>/<table>"),
    (["launcher=kubernetes", "+runtime=torch-distributed", *KUBEFLOW, "data.cache.kubeflow.metadata_loc=null"],
     "data.cache.kubeflow.metadata_loc=None: must be set for data.cache.backend=kubeflow"),
    (["+runtime=torch-distributed", *KUBEFLOW],
     "data.cache.backend='kubeflow': Kubeflow Trainer's cache runs on Kubernetes: give launcher=kubernetes"),
    (["data.cache.backend=ray"], "data.cache.backend='ray': must be one of trainjob, kubeflow"),
])
def test_bad_kubeflow_cache_settings_are_refused(overrides, message):
    cfg = compose(overrides)
    cfg.run_dir = "/nonexistent"
    with pytest.raises(config.ConfigError, match=message.replace("*", r"\*").replace("(", r"\(")):
        validate(cfg)
