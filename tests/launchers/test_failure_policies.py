"""Failure policies: a refused config fails a Kubernetes TrainJob at once, a preempted pod is not a failure,
`runtime.max_restarts` is the JobSet's, and node 0's success is the job's. The manifests are checked against
the real JobSet and Trainer CRDs (there is no API server here to run them); the exit codes those policies
read are checked on real processes: torchrun's agent (`trainjob.runtimes.torch_distributed.torchrun`) exits with
its rank's code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import compose_refused
from tests.launchers import crds
from tests.launchers.test_kubernetes import launcher_of, make_run, render

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("scheduler", ["none", "kueue", "volcano", "coscheduling", "kai"])
def test_the_derived_runtime_fails_fast_on_a_refusal_and_restarts_up_to_max_restarts(tmp_path, scheduler):
    queue = ["scheduler.queue=q"] if scheduler in ("kueue", "kai") else []
    docs = render(make_run(tmp_path, f"scheduler={scheduler}", *queue, "runtime.nnodes=2", "runtime.max_restarts=3"))
    runtime, trainjob = docs[0], docs[-1]
    assert runtime["kind"] == "TrainingRuntime"
    for doc in (runtime, trainjob):
        crds.validate(doc)
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["failurePolicy"] == {"maxRestarts": 3, "rules": [{
        "name": "RefusedConfig", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
        "targetReplicatedJobs": ["node"]}]}
    assert jobset["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["node"]}
    (node,) = [j for j in jobset["replicatedJobs"] if j["name"] == "node"]
    job = node["template"]["spec"]
    assert job["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "In", "values": [2]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
    assert job["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # what podFailurePolicy requires
    # The pod's agent passes the rank's exit code on, and leaves restarts to the JobSet.
    agent = "trainjob.runtimes.torch_distributed.torchrun"
    assert trainjob["spec"]["trainer"]["command"][:4] == ["python", "-m", agent, "--max-restarts=0"]


def test_kubeflows_cache_runtime_carries_no_policy_of_ours_so_max_restarts_is_refused_there(tmp_path, capsys):
    cache = ["data.cache.backend=kubeflow", "data.cache.nodes=2", "data.cache.kubeflow.storage_uri=cache://s/t",
             "data.cache.kubeflow.metadata_loc=s3a://b/m.json", "data.cache.kubeflow.iam_role=arn:aws:iam::1:role/c"]
    err = compose_refused(tmp_path, capsys, "launcher=kubernetes", "launcher.image=x", "+runtime=torch-distributed",
                          "runtime.max_restarts=2", *cache)
    assert err.count("\n") == 1 and "runtime.max_restarts=2: data.cache.backend=kubeflow runs on the cluster's cache " \
        "runtime, which carries no failure policy of trainjob's" in err, err
    run = make_run(tmp_path, *cache)
    text = launcher_of(run).render(run.spec)
    assert text.startswith("# failure policies: the cluster runtime's own (data.cache.backend=kubeflow runs on it)")
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob"]
    assert docs[-1]["spec"]["trainer"]["command"][3] == "--max-restarts=0"


def _agent(tmp_path, config: dict, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.run([sys.executable, "-m", "trainjob.runtimes.torch_distributed.torchrun", "--standalone",
                           "--nproc-per-node=1", *extra, "-m", "trainer.worker", str(path)],
                          capture_output=True, text=True, timeout=240, env=env)


def test_the_agent_exits_with_the_code_of_a_rank_that_refused_its_config(tmp_path):
    proc = _agent(tmp_path, {"model": {"name": "debug"}, "launcher": {"name": "local"}})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: " in proc.stderr
