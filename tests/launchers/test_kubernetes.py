"""The Kubernetes launcher: manifests valid against the real CRDs, equal to the SDK's where they overlap,
printed by a dry run, and submitted, watched, read and cancelled through the real `kubernetes` client.

No Kubernetes API server can run here: submission goes to `fake_apiserver.FakeApiServer`, an HTTP test
double on loopback that validates what it receives against the same CRD schemas.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import socket
import threading
import time

import pytest
import yaml

from launchers import JobState, LauncherError
from launchers import get as get_launcher
from launchers.kubernetes.manifests import to_yaml
from tests.conftest import compose_run
from tests.launchers import crds
from tests.launchers.fake_apiserver import FakeApiServer
from trainer import config
from trainer.config.compose import compose
from trainer.config.validate import validate

SDK = os.path.join(os.path.dirname(crds.DEFAULT_DIR), "sdk-0.5.0-customtrainer-trainjob.json")


def make_run(tmp_path, *overrides: str):
    """A Kubernetes run; several nodes share a claim for the run directory, as they must."""
    several = any(o.startswith("runtime.nnodes=") and o != "runtime.nnodes=1" for o in overrides)
    claim = ["launcher.run_claim=runs"] if several and not any("run_claim" in o for o in overrides) else []
    return compose_run(tmp_path, "launcher=kubernetes", "+runtime=torch-distributed", *claim, *overrides)


def launcher_of(run):
    return get_launcher(run.launcher, run.scheduler)


def render(run) -> list[dict]:
    return launcher_of(run).manifests(run.spec)


def job_name(run) -> str:
    return launcher_of(run).job_name(run.spec)


STRATEGY = {
    "ddp": [],
    "fsdp2": ["strategy=fsdp2"],
    "fsdp2_tp": ["strategy=fsdp2_tp", "runtime.nproc_per_node=4", "launcher.resources_per_node.gpu=4"],
}
MATRIX = list(itertools.product(["none", "kueue", "volcano", "coscheduling", "kai"], STRATEGY, [1, 2, 4]))


@pytest.mark.parametrize(("scheduler", "strategy", "nodes"), MATRIX, ids=["-".join(map(str, m)) for m in MATRIX])
def test_every_manifest_validates_against_the_crds(tmp_path, scheduler, strategy, nodes):
    run = make_run(
        tmp_path,
        f"scheduler={scheduler}",
        *STRATEGY[strategy],
        f"runtime.nnodes={nodes}",
        "launcher.resources_per_node.cpu=4",
        "launcher.resources_per_node.memory=16Gi",
        "+launcher.node_selector.pool=train",
        "launcher.active_deadline_seconds=3600",
        "+launcher.env.NCCL_DEBUG=WARN",
        "launcher.volumes=[{name: data, claim: corpus, mount_path: /data, read_only: true}]",
        "launcher.tolerations=[{key: gpu, operator: Exists, effect: NoSchedule}]",
    )
    manifests = render(run)
    kinds = [m["kind"] for m in manifests]
    expected = ["TrainingRuntime", "ConfigMap", "TrainJob"]  # every scheduler's job: its failure policies
    assert kinds == expected
    for m in manifests:
        if m["kind"] != "ConfigMap":
            crds.validate(m)
    trainjob = manifests[-1]
    assert trainjob["spec"]["trainer"]["numNodes"] == nodes
    (patch,) = trainjob["spec"]["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30  # train.preemption_grace_s: SIGTERM to SIGKILL
    assert trainjob["spec"]["trainer"]["numProcPerNode"] == (4 if strategy == "fsdp2_tp" else 1)
    assert not any(e["name"].startswith("PET_") for e in trainjob["spec"]["trainer"]["env"])
    pod_config = yaml.safe_load(manifests[-2]["data"]["config.yaml"])
    assert pod_config["run_dir"] == f"/workspace/runs/{trainjob['metadata']['name']}"
    assert pod_config["strategy"]["name"] == strategy


def test_scheduler_specifics(tmp_path):
    kueue = render(make_run(tmp_path, "scheduler=kueue", "scheduler.queue=team-a", "scheduler.priority_class=high"))
    assert kueue[-1]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert kueue[-1]["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    assert kueue[-1]["spec"]["suspend"] is True

    cosched = render(make_run(tmp_path, "scheduler=coscheduling", "scheduler.schedule_timeout_seconds=300"))
    assert cosched[0]["spec"]["podGroupPolicy"] == {"coscheduling": {"scheduleTimeoutSeconds": 300}}
    assert cosched[-1]["spec"]["runtimeRef"] == {"kind": "TrainingRuntime", "name": cosched[0]["metadata"]["name"]}

    volcano = render(make_run(tmp_path, "scheduler=volcano", "scheduler.queue=research"))
    assert volcano[0]["spec"]["podGroupPolicy"] == {"volcano": {}}
    assert volcano[-1]["metadata"]["annotations"]["scheduling.volcano.sh/queue-name"] == "research"

    kai = render(make_run(tmp_path, "scheduler=kai", "scheduler.queue=gpu-queue"))
    pod = kai[0]["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["spec"]["schedulerName"] == "kai-scheduler"
    assert pod["metadata"]["labels"]["kai.scheduler/queue"] == "gpu-queue"
    assert kai[-1]["metadata"]["labels"]["kai.scheduler/queue"] == "gpu-queue"


def test_trainjob_matches_what_the_official_sdk_submits(tmp_path):
    with open(SDK) as f:
        sdk = json.load(f)
    ours = render(
        make_run(
            tmp_path, "runtime.nnodes=2", "launcher.resources_per_node.cpu=3", "launcher.resources_per_node.memory=3Gi"
        )
    )[-1]
    assert ours["apiVersion"] == sdk["apiVersion"] and ours["kind"] == sdk["kind"]
    # The SDK names the cluster's runtime; ours is derived from that one, with the failure policies added.
    assert sdk["spec"]["runtimeRef"] == {"kind": "ClusterTrainingRuntime", "name": "torch-distributed"}
    assert ours["spec"]["runtimeRef"] == {"kind": "TrainingRuntime", "name": f"{ours['metadata']['name']}-runtime"}
    assert ours["spec"]["trainer"]["numNodes"] == sdk["spec"]["trainer"]["numNodes"]
    assert ours["spec"]["trainer"]["resourcesPerNode"] == sdk["spec"]["trainer"]["resourcesPerNode"]
    crds.validate(sdk)  # the reference itself passes the same strict validation


def test_job_names_are_rfc1035_unique_and_stable(tmp_path):
    a = make_run(tmp_path / "a", "hydra.run.dir=ignored")
    b = make_run(tmp_path / "b")
    assert job_name(a) != job_name(b) and job_name(a) == job_name(a)
    for name in (job_name(a), job_name(b)):
        assert crds.NAME.match(name) and len(name) <= 52
    assert job_name(make_run(tmp_path, "launcher.job_name=my-run")) == "my-run"


def test_dry_run_prints_yaml_for_kubectl_and_writes_nothing(run_cli, tmp_path):
    proc = run_cli(
        "launcher=kubernetes", "+runtime=torch-distributed", "scheduler=kueue", "launcher.dry_run=true", timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in docs] == ["TrainingRuntime", "ConfigMap", "TrainJob"]
    crds.validate(docs[0])
    crds.validate(docs[2])
    said = [line for line in proc.stdout.splitlines() if line.startswith("#")]
    assert said[0] == "# failure policies (the derived TrainingRuntime):"
    assert "#   exit 2 (a refused config or input) fails the job at once" in " ".join(said)
    assert "#   any other failure restarts the JobSet up to runtime.max_restarts=0 times" in " ".join(said)
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["launcher=kubernetes"], "runtime=None: launcher=kubernetes runs torchrun on every node"),
        (
            ["launcher=kubernetes", "+runtime=torch-distributed", "launcher.job_name=Bad_Name"],
            "launcher.job_name='Bad_Name': must be an RFC 1035 label",
        ),
        (
            ["launcher=kubernetes", "+runtime=torch-distributed", "+launcher.env.PET_NNODES=3"],
            "launcher.env.PET_NNODES='3': PET_* variables are set by the Kubeflow Trainer torch plugin",
        ),
        (["scheduler=kueue"], "scheduler='kueue': gang schedulers run on Kubernetes"),
        (
            ["launcher=kubernetes", "+runtime=torch-distributed", "scheduler=kai", "scheduler.queue=null"],
            "scheduler.queue=None: scheduler=kai needs the queue",
        ),
        (
            ["launcher=kubernetes", "+runtime=torch-distributed", "runtime.nnodes=2"],
            "launcher.run_claim=None: runtime.nnodes=2 needs a shared PersistentVolumeClaim",
        ),
    ],
)
def test_bad_launcher_configs_are_refused(overrides, message):
    cfg = compose(overrides)
    cfg.run_dir = "/nonexistent"
    with pytest.raises(config.ConfigError, match=message.replace("*", r"\*").replace("(", r"\(")):
        validate(cfg)


@pytest.fixture
def apiserver(tmp_path):
    with FakeApiServer() as server:
        with open(os.path.join(os.path.dirname(crds.DEFAULT_DIR), "runtimes", "torch_distributed.yaml")) as f:
            server.objects[("clustertrainingruntimes", "", "torch-distributed")] = yaml.safe_load(f)
        yield server, server.kubeconfig(str(tmp_path / "kubeconfig"))


def test_a_steps_device_is_read_from_its_pods_limits_as_kubeflows_sdk_reads_it(tmp_path, apiserver):
    """Each step's device and count, as Kubeflow's SDK reads them from its pod's container `node` (its limits:
    GPUs, MIG, else CPUs, each limit the count; torch's PET_NPROC_PER_NODE the count where it is a number);
    Unknown where the pod says nothing of them."""
    server, kubeconfig = apiserver
    run = make_run(tmp_path, f"launcher.kubeconfig={kubeconfig}", "launcher.namespace=ml", "runtime.nnodes=2")
    job = launcher_of(run).launch(run.spec)
    server.add_pod("ml", job.name, 0, "Running")
    assert [(s.name, s.device, s.device_count) for s in job.info().steps] == [("node-0", "Unknown", "Unknown")]
    for limits, env, want in (({"cpu": "4", "memory": "8Gi"}, [], ("cpu", "4")),
                              ({"cpu": "4", "nvidia.com/gpu": "2"}, [], ("gpu", "2")),
                              ({"nvidia.com/mig-1g.5gb": "1"}, [], ("mig-1g.5gb", "1")),
                              ({"cpu": "2"}, [{"name": "PET_NPROC_PER_NODE", "value": "3"}], ("cpu", "3")),
                              ({"memory": "1Gi"}, [], ("Unknown", "Unknown"))):
        server.add_pod("ml", job.name, 1, "Running", container={"resources": {"limits": limits}, "env": env})
        assert (job.info().steps[1].device, job.info().steps[1].device_count) == want


def test_submit_status_logs_cancel_and_list_through_the_kubernetes_client(tmp_path, apiserver):
    server, kubeconfig = apiserver
    run = make_run(
        tmp_path,
        "scheduler=volcano",
        f"launcher.kubeconfig={kubeconfig}",
        "launcher.namespace=ml",
        "runtime.nnodes=2",
        "launcher.poll_seconds=0.01",
    )
    launcher = launcher_of(run)
    job = launcher.launch(run.spec)
    name = job.name
    trainjob = server.objects[("trainjobs", "ml", name)]
    config_map = server.objects[("configmaps", "ml", f"{name}-config")]
    runtime = server.objects[("trainingruntimes", "ml", f"{name}-runtime")]
    for owned in (config_map, runtime):
        assert owned["metadata"]["ownerReferences"][0]["uid"] == trainjob["metadata"]["uid"]
    assert runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"
    ][0]["image"].startswith("pytorch/pytorch")  # derived from the cluster's runtime
    assert os.path.isfile(os.path.join(run.spec.run_dir, "manifests.yaml"))

    assert job.status() == JobState.CREATED
    server.add_pod("ml", name, 0, "Running", log="step 1 loss 5.5\nstep 2 loss 4.8\n")
    server.add_pod("ml", name, 1, "Pending")
    assert job.status() == JobState.RUNNING
    assert list(job.logs(0)) == ["step 1 loss 5.5", "step 2 loss 4.8"]
    assert [(s.name, s.status, s.pod_name) for s in job.info().steps] == [
        ("node-0", JobState.RUNNING, f"{name}-node-0-0-abcde"), ("node-1", JobState.CREATED, f"{name}-node-1-0-abcde")]
    assert list(job.step_logs("node-0")) == ["step 1 loss 5.5", "step 2 loss 4.8"]
    server.add_pod("ml", name, 0, "Running", log="rank 0\nrank 1\n", role="launcher")  # as an MPI job's
    assert [s.name for s in job.info().steps] == ["node-0", "node-1", "node-2"]
    assert list(job.step_logs("node-0")) == ["rank 0", "rank 1"]  # the launcher: every rank's output
    assert list(job.step_logs("node-1")) == ["step 1 loss 5.5", "step 2 loss 4.8"]  # node pod 0
    server.set_conditions("ml", name, Suspended="True")
    assert job.status() == JobState.CREATED
    server.set_conditions("ml", name, Complete="True")
    assert job.wait(timeout=5) == JobState.COMPLETE
    server.set_conditions("ml", name, Failed="True")
    assert job.status() == JobState.FAILED

    assert [j.name for j in launcher.list_jobs()] == [name]
    assert (
        get_launcher({"name": "kubernetes", "namespace": "ml", "kubeconfig": kubeconfig}).job(name).status()
        == JobState.FAILED
    )
    job.cancel()
    assert job.status() == JobState.CANCELLED
    assert ("trainjobs", "ml", name) not in server.objects
    assert ("configmaps", "ml", f"{name}-config") not in server.objects  # garbage-collected with its owner


def test_api_errors_become_clear_messages(tmp_path, apiserver):
    server, kubeconfig = apiserver
    run = make_run(tmp_path, f"launcher.kubeconfig={kubeconfig}", "launcher.job_name=taken")
    launcher_of(run).launch(run.spec)
    with pytest.raises(LauncherError, match="TrainingRuntime 'taken-runtime' in namespace 'default': it already "
                                            "exists"):
        launcher_of(run).launch(run.spec)

    server.forbidden_namespaces.add("locked")
    locked = make_run(tmp_path, f"launcher.kubeconfig={kubeconfig}", "launcher.namespace=locked")
    with pytest.raises(LauncherError, match="forbidden to create TrainingRuntime .* in namespace 'locked'"):
        launcher_of(locked).launch(locked.spec)

    missing = make_run(
        tmp_path, f"launcher.kubeconfig={kubeconfig}", "scheduler=coscheduling", "launcher.runtime_ref=no-such-runtime"
    )
    with pytest.raises(LauncherError, match="get ClusterTrainingRuntime 'no-such-runtime'.*not found; is Kubeflow"):
        launcher_of(missing).launch(missing.spec)

    invalid = make_run(
        tmp_path,
        f"launcher.kubeconfig={kubeconfig}",
        "launcher.job_name=bad",
        f"launcher.image=registry.example/{'x' * 490}",
    )  # the CRD allows 500 characters
    with pytest.raises(
        LauncherError, match="rejected create TrainJob 'bad' in namespace 'default' as invalid: .*is too long"
    ):
        launcher_of(invalid).launch(invalid.spec)
    assert ("configmaps", "default", "bad-config") not in server.objects  # rolled back

    with pytest.raises(LauncherError, match="no usable Kubernetes config"):
        get_launcher({"name": "kubernetes", "kubeconfig": str(tmp_path / "absent")}).list_jobs()


def test_sweep_submits_one_trainjob_per_point_and_waits_for_their_losses(run_cli, tmp_path, apiserver):
    server, kubeconfig = apiserver
    shared = tmp_path / "shared-runs"

    def cluster_runs(trainjob):  # each job "trains" on the cluster and leaves its summary on shared storage
        name = trainjob["metadata"]["name"]
        lr = yaml.safe_load(server.objects[("configmaps", "default", f"{name}-config")]["data"]["config.yaml"])[
            "optim"
        ]["lr"]
        os.makedirs(shared / name)
        (shared / name / "summary.json").write_text(json.dumps({"final_eval_loss": 2.0 + lr, "steps": 5}))
        trainjob["status"] = {
            "conditions": [
                {
                    "type": "Complete",
                    "status": "True",
                    "reason": "Done",
                    "message": "done",
                    "lastTransitionTime": "2026-11-29T00:00:00Z",
                }
            ]
        }

    server.on_trainjob = cluster_runs
    proc = run_cli(
        "-m",
        "launcher=kubernetes",
        "+runtime=torch-distributed",
        "optim.lr=1e-3,3e-4",
        f"launcher.kubeconfig={kubeconfig}",
        "launcher.wait=true",
        "launcher.run_claim=runs",
        f"launcher.local_run_root={shared}",
        "launcher.poll_seconds=0.05",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(name for (plural, _, name) in server.objects if plural == "trainjobs")
    assert len(jobs) == 2
    assert "final eval loss: 2.0010" in proc.stdout and "final eval loss: 2.0003" in proc.stdout
    for name in jobs:
        pod = server.objects[("trainjobs", "default", name)]["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]
        volumes = pod["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"]
        assert {"name": "trainjob-runs", "persistentVolumeClaim": {"claimName": "runs"}} in volumes


@pytest.mark.e2e
def test_optuna_sweep_reads_each_trainjobs_metrics_on_the_shared_storage_and_deletes_a_pruned_one(
    run_cli, tmp_path, apiserver
):
    """hydra/sweeper=optuna on Kubernetes: two TrainJobs at once; the API double plays the cluster, each job
    writing an eval line every 0.3 s to the shared storage (a larger lr, a lower loss) until it is deleted.
    With seed 1 the third trial's lr is 1e-7: the median pruner stops it, and the sweeper
    deletes its TrainJob through the kubernetes client (`python -m launchers delete`)."""
    server, kubeconfig = apiserver
    shared = tmp_path / "shared-runs"

    def train(name: str, lr: float) -> None:
        run = shared / name
        os.makedirs(run, exist_ok=True)
        for step in range(10, 301, 10):
            if ("trainjobs", "default", name) not in server.objects:
                return  # deleted: its pods are gone
            loss = 5.0 - step / 300 * (math.log10(lr) + 8) / 3
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "eval_loss": loss}) + "\n")
            time.sleep(0.3)
        if ("trainjobs", "default", name) not in server.objects:
            return  # deleted after its last eval line
        (run / "summary.json").write_text(json.dumps({"final_eval_loss": loss, "steps": 300}))
        server.set_conditions("default", name, Complete="True")

    def cluster_runs(trainjob):
        name = trainjob["metadata"]["name"]
        config_map = server.objects[("configmaps", "default", f"{name}-config")]
        lr = yaml.safe_load(config_map["data"]["config.yaml"])["optim"]["lr"]
        threading.Thread(target=train, args=(name, lr), daemon=True).start()

    server.on_trainjob = cluster_runs
    proc = run_cli(
        "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2", "hydra.sweeper.seed=1",
        "hydra.sweeper.pruner=median", "hydra.sweeper.pruner_startup_trials=2",
        "optim.lr=tag(log, interval(1e-7, 1e-2))", "launcher=kubernetes", "+runtime=torch-distributed",
        f"launcher.kubeconfig={kubeconfig}", "launcher.wait=true", "launcher.run_claim=runs",
        f"launcher.local_run_root={shared}", "launcher.poll_seconds=0.05", f"hydra.sweep.dir={tmp_path / 'sweep'}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = [f"tj-sweep-{hashlib.sha256(str(tmp_path / 'sweep').encode()).hexdigest()[:8]}-{n}" for n in range(3)]
    for name in names[:2]:
        conditions = server.objects[("trainjobs", "default", name)]["status"]["conditions"]
        assert conditions[0]["type"] == "Complete"
    assert ("trainjobs", "default", names[2]) not in server.objects
    (event,) = [json.loads(line) for line in (shared / names[2] / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "pruned" and event["at_step"] < 300
    assert f"trial 2: pruned at step {event['at_step']}" in proc.stdout
    assert not (shared / names[2] / "summary.json").exists()


def _with_token(run):
    secrets = {"TRAINJOB_CACHE_TOKEN": "s3cret-t0ken"}
    return dataclasses.replace(run, spec=dataclasses.replace(run.spec, secrets=secrets))


def test_secrets_travel_in_a_secret_owned_by_the_trainjob_and_are_never_written(tmp_path, apiserver):
    server, kubeconfig = apiserver
    run = _with_token(make_run(tmp_path, f"launcher.kubeconfig={kubeconfig}", "launcher.namespace=ml"))
    printed = to_yaml(render(run))
    assert "s3cret-t0ken" not in printed
    docs = render(run)
    assert [d["kind"] for d in docs] == ["TrainingRuntime", "ConfigMap", "Secret", "TrainJob"]
    crds.validate(docs[-1])
    name = job_name(run)
    env = {e["name"]: e for e in docs[-1]["spec"]["trainer"]["env"]}
    assert env["TRAINJOB_CACHE_TOKEN"] == {
        "name": "TRAINJOB_CACHE_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": f"{name}-secrets", "key": "TRAINJOB_CACHE_TOKEN"}},
    }

    launcher_of(run).launch(run.spec)
    secret = server.objects[("secrets", "ml", f"{name}-secrets")]
    assert secret["stringData"] == {"TRAINJOB_CACHE_TOKEN": "s3cret-t0ken"}
    assert (
        secret["metadata"]["ownerReferences"][0]["uid"] == server.objects[("trainjobs", "ml", name)]["metadata"]["uid"]
    )
    manifests = os.path.join(run.spec.run_dir, "manifests.yaml")
    assert os.stat(manifests).st_mode & 0o777 == 0o600
    with open(manifests) as f:
        text = f.read()
    assert "s3cret-t0ken" not in text and "kind: Secret" in text


def test_a_failed_submit_removes_what_it_created_and_writes_no_manifests(tmp_path, apiserver):
    server, kubeconfig = apiserver
    run = _with_token(
        make_run(
            tmp_path,
            f"launcher.kubeconfig={kubeconfig}",
            "launcher.job_name=bad",
            f"launcher.image=registry.example/{'x' * 490}",
        )
    )  # the CRD allows 500 characters
    with pytest.raises(LauncherError, match="rejected create TrainJob 'bad'"):
        launcher_of(run).launch(run.spec)
    assert [key for key in server.objects if key[0] in ("configmaps", "secrets", "trainjobs")] == []
    assert ("DELETE", "/api/v1/namespaces/default/secrets/bad-secrets") in server.requests
    assert not os.path.exists(os.path.join(run.spec.run_dir, "manifests.yaml"))


def _closed_port_kubeconfig(tmp_path) -> tuple[str, int]:
    """A kubeconfig whose API server is a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    return str(kubeconfig), port


def test_an_unreachable_api_server_is_one_clear_error(tmp_path):
    kubeconfig, port = _closed_port_kubeconfig(tmp_path)
    run = make_run(tmp_path, f"launcher.kubeconfig={kubeconfig}")
    with pytest.raises(
        LauncherError,
        match=rf"cannot reach the API server at http://127.0.0.1:{port} to get "
        r"ClusterTrainingRuntime 'torch-distributed'",
    ):
        launcher_of(run).launch(run.spec)
    assert not os.path.exists(os.path.join(run.spec.run_dir, "manifests.yaml"))


def test_an_unreachable_api_server_ends_the_cli_with_one_line_and_exit_1(run_cli, tmp_path):
    kubeconfig, port = _closed_port_kubeconfig(tmp_path)
    proc = run_cli(
        "launcher=kubernetes",
        "+runtime=torch-distributed",
        f"launcher.kubeconfig={kubeconfig}",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(
        rf"error: Kubernetes API: cannot reach the API server at "
        rf"http://127.0.0.1:{port} to get ClusterTrainingRuntime 'torch-distributed': ",
        lines[0],
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "manifests.yaml").exists()


def _validated_by_the_client(manifest: dict) -> None:
    """The `kubernetes` client's own model of the kind takes the manifest whole: nothing dropped, misnamed
    or of the wrong type (the model's serialisation gives back exactly what went in)."""
    from kubernetes import client

    api = client.ApiClient()
    model = api.deserialize(json.dumps(manifest), f"V1{manifest['kind']}", "application/json")
    assert api.sanitize_for_serialization(model) == manifest


def test_cache_nodes_are_a_statefulset_behind_a_headless_service_owned_by_the_trainjob(tmp_path, apiserver):
    server, kubeconfig = apiserver
    run = make_run(
        tmp_path,
        f"launcher.kubeconfig={kubeconfig}",
        "launcher.namespace=ml",
        "data.cache.nodes=3",
        "data.cache.token=s3cret",
        "runtime.nnodes=2",
    )
    name = job_name(run)
    docs = render(run)
    assert [d["kind"] for d in docs] == ["TrainingRuntime", "ConfigMap", "Secret", "Service", "StatefulSet", "TrainJob"]
    for doc in docs[1:-1]:
        _validated_by_the_client(doc)
    crds.validate(docs[0])
    crds.validate(docs[-1])
    sts = docs[4]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == f"{name}-cache"
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "trainer.data.cache_node", "/etc/trainjob/config.yaml", "--shard",
                                    "$(POD_INDEX)/3", "--host", "0.0.0.0", "--port", "50051", "--eval-port", "50052"]
    assert container["readinessProbe"]["exec"]["command"] == ["python", "-m", "datacache", "ready",
                                                              "grpc://127.0.0.1:50051"]
    assert {
        "name": "TRAINJOB_CACHE_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": f"{name}-secrets", "key": "TRAINJOB_CACHE_TOKEN"}},
    } in container["env"]
    env = {e["name"]: e.get("value") for e in docs[-1]["spec"]["trainer"]["env"]}
    pods = [f"grpc://{name}-cache-{i}.{name}-cache.ml.svc:50051" for i in range(3)]
    assert env["TRAINJOB_CACHE_ENDPOINTS"] == "[" + ",".join(pods) + "]"
    # the nodes get the same list: each advertises its entry and answers for all (trainer.data.cache_node)
    assert {"name": "TRAINJOB_CACHE_ENDPOINTS", "value": env["TRAINJOB_CACHE_ENDPOINTS"]} in container["env"]
    assert env["TRAINJOB_CACHE_EVAL_ENDPOINTS"] == f"[grpc://{name}-cache-0.{name}-cache.ml.svc:50052]"
    assert "s3cret" not in to_yaml(docs)

    job = launcher_of(run).launch(run.spec)
    uid = server.objects[("trainjobs", "ml", name)]["metadata"]["uid"]
    for plural in ("services", "statefulsets"):
        assert server.objects[(plural, "ml", f"{name}-cache")]["metadata"]["ownerReferences"][0]["uid"] == uid
    posts = [path for method, path in server.requests if method == "POST"]
    assert posts.index("/apis/apps/v1/namespaces/ml/statefulsets") < posts.index(
        "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs"
    )
    job.cancel()
    assert not [key for key in server.objects if key[0] in ("services", "statefulsets")]  # deleted with the job
