"""Models, data and checkpoints in stores on `launcher=kubernetes` (launchers/kubernetes/initializers.py,
cluster_runtimes.py): an hf:// model and an s3:// corpus become Kubeflow's model and dataset initializers (the
TrainJob's `spec.initializer`, the initializer jobs in the job's derived runtime, the ranks reading /workspace/model
and /workspace/dataset), valid against the v2.3.0 CRDs; credentials come from the Secret `launcher.storage_secret`
by name and key, and no value of the driver's environment is in any manifest; `launcher.runtime_ref` runs a job
on an admin's ClusterTrainingRuntime, creating none; the ClusterTrainingRuntimes printed for that admin validate.
No Kubernetes API server runs here: these are the manifests the launcher submits, checked against the CRDs."""

from __future__ import annotations

import copy
import dataclasses

import yaml

from launchers.kubernetes import cluster_runtimes, initializers
from launchers.kubernetes.manifests import to_yaml
from tests.launchers import crds
from tests.launchers.test_kubernetes import launcher_of, make_run

SECRET = "storage-creds"


def _with_urls(run, model: str, data: str):
    config = copy.deepcopy(run.spec.config)
    config["model"]["path"], config["data"]["path"] = model, data
    return dataclasses.replace(run, spec=dataclasses.replace(run.spec, config=config))


def test_urls_become_kubeflows_initializers_crd_valid_with_no_secret_value(s3, tmp_path):
    run = _with_urls(make_run(tmp_path, f"launcher.storage_secret={SECRET}", f"train.checkpoint_dir={s3.url('ckpt')}"),
                     "hf://Qwen/Qwen2.5-0.5B-Instruct", "s3://corpora/chats/train/*.parquet")
    docs = launcher_of(run).manifests(run.spec)
    assert [d["kind"] for d in docs] == ["TrainingRuntime", "ConfigMap", "TrainJob"]
    runtime, config_map, trainjob = docs
    for doc in (runtime, trainjob):
        crds.validate(doc)
    assert trainjob["spec"]["initializer"] == {
        "model": {"storageUri": "hf://Qwen/Qwen2.5-0.5B-Instruct", "secretRef": {"name": SECRET}},
        "dataset": {"storageUri": "s3://corpora/chats/train", "secretRef": {"name": SECRET}},
    }
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == ["dataset-initializer", "model-initializer", "node"]
    assert jobs[2]["dependsOn"] == [{"name": "dataset-initializer", "status": "Complete"},
                                    {"name": "model-initializer", "status": "Complete"}]
    for job in jobs:
        container = job["template"]["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "initializer", "mountPath": "/workspace"} in container["volumeMounts"]
    assert jobs[0]["template"]["spec"]["template"]["spec"]["containers"][0]["image"] == initializers.IMAGES["dataset"]
    assert runtime["spec"]["template"]["spec"]["volumeClaimPolicies"][0]["templates"][0]["metadata"]["name"] == \
        "initializer"
    ranks = yaml.safe_load(next(iter(config_map["data"].values())))
    assert (ranks["model"]["path"], ranks["data"]["path"]) == ("/workspace/model", "/workspace/dataset/*.parquet")
    assert ranks["train"]["checkpoint_dir"] == s3.url("ckpt")  # written by the ranks themselves
    env = {e["name"]: e for e in trainjob["spec"]["trainer"]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": SECRET, "key": "SECRET_ACCESS_KEY", "optional": True}}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "ACCESS_TOKEN"
    text = to_yaml(docs)
    for value in (s3.env["AWS_SECRET_ACCESS_KEY"], s3.env["AWS_ACCESS_KEY_ID"]):
        assert value not in text  # the driver's credentials stay on this machine
    assert not any(d["kind"] == "Secret" for d in docs)


def test_a_hub_dataset_url_and_an_s3_model_map_to_the_initializers_paths(tmp_path):
    run = _with_urls(make_run(tmp_path), "s3://models/tiny", "hf://datasets/org/chats/data/*.jsonl")
    assert initializers.uris(run.spec.config) == {"model": ("s3://models/tiny", ""),
                                                  "dataset": ("hf://org/chats", "data/*.jsonl")}
    runtime, config_map, trainjob = launcher_of(run).manifests(run.spec)
    crds.validate(runtime)
    crds.validate(trainjob)
    assert "secretRef" not in trainjob["spec"]["initializer"]["model"]  # no launcher.storage_secret: public data
    ranks = yaml.safe_load(next(iter(config_map["data"].values())))
    assert ranks["data"]["path"] == "/workspace/dataset/data/*.jsonl"
    assert not any(e["name"].startswith("AWS_") for e in trainjob["spec"]["trainer"]["env"])


def test_runtime_ref_runs_on_an_admins_cluster_runtime_and_creates_none(tmp_path):
    run = _with_urls(make_run(tmp_path, "scheduler=volcano", "launcher.runtime_ref=trainjob-torch-volcano-initializers",
                              f"launcher.storage_secret={SECRET}"), "hf://org/model", "s3://b/c/*.parquet")
    docs = launcher_of(run).manifests(run.spec)
    assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob"]
    crds.validate(docs[1])
    assert docs[1]["spec"]["runtimeRef"] == {"kind": "ClusterTrainingRuntime",
                                             "name": "trainjob-torch-volcano-initializers"}
    assert set(docs[1]["spec"]["initializer"]) == {"model", "dataset"}
    said = launcher_of(run).render(run.spec).splitlines()[0]
    assert said.startswith("# failure policies, initializers and pod group: the ClusterTrainingRuntime "
                           "trainjob-torch-volcano-initializers's own")


def test_the_cluster_runtimes_an_admin_applies_validate_and_carry_policies_and_initializers(capsys):
    assert cluster_runtimes.main(["--image", "me/trainjob:1", "--max-restarts", "3"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs == cluster_runtimes.cluster_runtimes("me/trainjob:1", 3)
    assert [d["metadata"]["name"] for d in docs] == [
        f"trainjob-torch{g}{i}" for g in ("", "-volcano", "-coscheduling", "-kai") for i in ("", "-initializers")]
    for doc in docs:
        assert doc["kind"] == "ClusterTrainingRuntime" and "namespace" not in doc["metadata"]
        crds.validate(doc)
        spec = doc["spec"]["template"]["spec"]
        assert spec["failurePolicy"]["maxRestarts"] == 3
        names = [j["name"] for j in spec["replicatedJobs"]]
        fetches = doc["metadata"]["name"].endswith("-initializers")
        assert names == (["dataset-initializer", "model-initializer", "node"] if fetches else ["node"])
    by_name = {d["metadata"]["name"]: d["spec"] for d in docs}
    assert by_name["trainjob-torch-volcano"]["podGroupPolicy"] == {"volcano": {}}
    assert by_name["trainjob-torch-coscheduling-initializers"]["podGroupPolicy"] == {"coscheduling": {}}
    kai = by_name["trainjob-torch-kai"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert kai["spec"]["schedulerName"] == "kai-scheduler"


def test_the_drivers_dry_run_keeps_a_model_url_for_the_initializer(s3, run_cli, tmp_path):
    """`python -m trainer launcher=kubernetes model=hf model.path=s3://...`: the driver reads the model's config.json
    from its fetched copy, but the TrainJob names the URL for Kubeflow's model initializer and the ranks read
    /workspace/model (never this machine's copy)."""
    from tests.trainer.hf_models import make_llama

    url = s3.upload_dir(make_llama(str(tmp_path / "m")), "models/tiny")
    proc = run_cli("launcher=kubernetes", "+runtime=torch-distributed", "launcher.dry_run=true", "model=hf",
                   f"model.path={url}", f"launcher.storage_secret={SECRET}", "data=parquet",
                   "data.path=s3://corpora/text/*.parquet", timeout=120, env=s3.env)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    trainjob = next(d for d in docs if d["kind"] == "TrainJob")
    crds.validate(trainjob)
    assert trainjob["spec"]["initializer"]["model"] == {"storageUri": url, "secretRef": {"name": SECRET}}
    assert trainjob["spec"]["initializer"]["dataset"]["storageUri"] == "s3://corpora/text"
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    ranks = yaml.safe_load(next(iter(config_map["data"].values())))
    assert ranks["model"]["path"] == "/workspace/model" and ranks["model"]["dim"] == 64
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in proc.stdout
