"""`launcher=kubernetes runtime=mpi`: the TrainingRuntime derived from Kubeflow's MPI runtime (the shipped
`deepspeed-distributed` ClusterTrainingRuntime, read from ../shared/reference as the cluster would serve it, or
the built-in copy of a dry run) carries mlPolicy.mpi and the framework label, the TrainJob runs mpirun from the
launcher, and every manifest validates against the v2.3.0 CRDs. No API server runs here: the manifests are what
is checked, against the real schemas."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from launchers import get as get_launcher
from tests.conftest import compose_run
from tests.launchers import crds
from trainjob import runtimes

RUNTIMES = os.path.join(os.path.dirname(crds.DEFAULT_DIR), "runtimes")
MPI = ["launcher=kubernetes", "runtime=mpi", "runtime.nproc_per_node=4", "runtime.nnodes=2",
       "launcher.run_claim=runs", "launcher.resources_per_node.cpu=4"]


def _manifests(tmp_path, *overrides, cluster_runtime=None):
    run = compose_run(tmp_path, *MPI, *overrides)
    return run, get_launcher(run.launcher, run.scheduler).manifests(run.spec, cluster_runtime)


def _shipped(name: str) -> dict:
    with open(os.path.join(RUNTIMES, f"{name.replace('-', '_')}.yaml")) as f:
        return yaml.safe_load(f)


def test_an_mpi_job_derives_its_runtime_from_kubeflows_mpi_runtime_and_validates(tmp_path):
    shipped = _shipped("deepspeed-distributed")
    for base in (shipped["spec"], None):  # the cluster's runtime as served, or the dry run's built-in copy
        _, manifests = _manifests(tmp_path, "scheduler=kueue", cluster_runtime=base)
        assert [m["kind"] for m in manifests] == ["TrainingRuntime", "ConfigMap", "TrainJob"]
        for m in manifests:
            if m["kind"] != "ConfigMap":
                crds.validate(m)
        runtime, trainjob = manifests[0], manifests[-1]
        assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "mpi"
        assert runtime["spec"]["mlPolicy"]["mpi"] == {"numProcPerNode": 4, "mpiImplementation": "OpenMPI",
                                                      "sshAuthMountPath": "/root/.ssh", "runLauncherAsNode": True}
        jobs = {j["name"]: j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
        assert set(jobs) == {"node", "launcher"}
        # Every host runs the run's image; the job succeeds, and a refusal (exit 2) fails it, with the launcher.
        for job in jobs.values():
            assert job["template"]["spec"]["template"]["spec"]["containers"][0]["image"] == "trainjob:latest"
        assert runtime["spec"]["template"]["spec"]["successPolicy"]["targetReplicatedJobs"] == ["launcher"]
        assert "podFailurePolicy" in jobs["launcher"]["template"]["spec"]
        assert trainjob["spec"]["runtimeRef"] == {"kind": "TrainingRuntime", "name": runtime["metadata"]["name"]}
        trainer = trainjob["spec"]["trainer"]
        assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 4
        assert trainer["command"][0] == "mpirun" and trainer["command"][-3:] == [
            "-m", "trainer.worker", "/etc/trainjob/config.yaml"]
        assert "-p 2222" in trainer["command"][trainer["command"].index("plm_rsh_args") + 1]
        patched = [j["name"] for j in trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
            "replicatedJobs"]]
        assert patched == ["node", "launcher"]  # both read the config and the run directory
        assert not {e["name"] for e in trainer["env"]} & {"OMPI_MCA_orte_default_hostfile", "OMPI_MCA_plm_rsh_args"}


def test_the_runtime_ref_names_the_shipped_cluster_runtime(tmp_path):
    from launchers.kubernetes.manifests import cluster_runtime

    run, _ = _manifests(tmp_path)
    assert cluster_runtime(run.spec, run.launcher) == _shipped("deepspeed-distributed")["metadata"]["name"]
    torch = compose_run(tmp_path / "torch", "launcher=kubernetes", "runtime=torch-distributed")
    assert cluster_runtime(torch.spec, torch.launcher) == _shipped("torch-distributed")["metadata"]["name"]


def test_dry_run_prints_the_mpi_trainjob(tmp_path, cache_dir):
    proc = subprocess.run([sys.executable, "-m", "trainer", *MPI, "launcher.dry_run=true",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "TRAINJOB_CACHE": cache_dir}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert [d["kind"] for d in docs] == ["TrainingRuntime", "ConfigMap", "TrainJob"]
    assert docs[0]["spec"]["mlPolicy"]["mpi"]["numProcPerNode"] == 4
    assert not (tmp_path / "run").exists()


def test_a_deepspeed_job_derives_its_runtime_from_the_shipped_deepspeed_runtime_and_the_dry_run_prints_it(
        tmp_path, cache_dir):
    args = ["launcher=kubernetes", "runtime=deepspeed-distributed", "strategy=deepspeed", "strategy.zero_stage=3",
            "runtime.nproc_per_node=2", "runtime.nnodes=2", "launcher.run_claim=runs"]
    proc = subprocess.run([sys.executable, "-m", "trainer", *args, "launcher.dry_run=true",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "TRAINJOB_CACHE": cache_dir}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert [d["kind"] for d in docs] == ["TrainingRuntime", "ConfigMap", "TrainJob"]
    runtime, config, trainjob = docs
    for m in (runtime, trainjob):
        crds.validate(m)
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "deepspeed"
    assert runtime["spec"]["mlPolicy"]["mpi"]["numProcPerNode"] == 2 and trainjob["spec"]["trainer"]["numNodes"] == 2
    assert trainjob["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert trainjob["spec"]["trainer"]["command"][0] == "mpirun"
    assert "zero_stage: 3" in next(iter(config["data"].values()))
    run = compose_run(tmp_path / "c", *args)
    from launchers.kubernetes.manifests import cluster_runtime

    assert cluster_runtime(run.spec, run.launcher) == _shipped("deepspeed-distributed")["metadata"]["name"]
# --- function jobs on every runtime (Client("kubernetes").train(func=...)) ------------------------------------

def _sum_ranks(lr):
    import os

    print(os.environ.get("JAX_PROCESS_ID"), lr)


# What each function-only runtime's TrainJob runs: the SDK 0.5.0 templates' entrypoints (RUNTIMES.md §7), on our
# shipped file (deepspeed-distributed, which trains too, derives its runtime as mpi does).
FUNCTION_COMMANDS = {
    "jax-distributed": ["python", "/etc/trainjob/train_func.py"],
    "xgboost-distributed": ["python", "/etc/trainjob/train_func.py"],
    "mlx-distributed": ["mpirun", "--hostfile", "/etc/mpi/hostfile", "python", "/etc/trainjob/train_func.py"],
}


def test_function_jobs_on_every_kubeflow_runtime_name_the_shipped_runtime_and_validate(tmp_path):
    from launchers import Client
    from tests.launchers.fake_apiserver import FakeApiServer

    with FakeApiServer() as server:
        for name in FUNCTION_COMMANDS:
            server.objects[("clustertrainingruntimes", "", name)] = _shipped(name)
        kubeconfig = server.kubeconfig(str(tmp_path / "kubeconfig"))
        client = Client("kubernetes", namespace="ml", kubeconfig=kubeconfig)
        for name, command in FUNCTION_COMMANDS.items():
            job = client.train(func=_sum_ranks, func_args={"lr": 0.1}, runtime=name, num_nodes=2,
                               resources_per_node={"cpu": 2, "memory": "4Gi"}, run_dir=str(tmp_path / name))
            trainjob = server.objects[("trainjobs", "ml", job)]  # the double validated it against the CRD
            crds.validate(trainjob)
            ref = trainjob["spec"]["runtimeRef"]
            shipped = server.objects[("clustertrainingruntimes", "", ref["name"])]
            assert ref == {"kind": "ClusterTrainingRuntime", "name": name}
            assert shipped["metadata"]["labels"]["trainer.kubeflow.org/framework"] == runtimes.get(name).framework
            trainer = trainjob["spec"]["trainer"]
            assert trainer["command"] == command and "image" not in trainer  # the shipped runtime's image
            assert trainer["numNodes"] == 2
            assert trainer["resourcesPerNode"] == {"limits": {"cpu": 2.0, "memory": "4Gi"},
                                                   "requests": {"cpu": 2.0, "memory": "4Gi"}}
            # The plugins set their own variables (DMLC_* are reserved: a TrainJob setting one is refused).
            assert not {e["name"] for e in trainer["env"]} & {"JAX_PROCESS_ID", "DMLC_TASK_ID", "DMLC_TRACKER_URI",
                                                              "OMPI_MCA_orte_default_hostfile"}
            shipped_file = server.objects[("configmaps", "ml", f"{job}-config")]["data"]["train_func.py"]
            assert shipped_file.rstrip().endswith("_run(_sum_ranks, {'lr': 0.1})")
            patched = trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
            jobs = {j["name"] for j in shipped["spec"]["template"]["spec"]["replicatedJobs"]}
            assert {j["name"] for j in patched["replicatedJobs"]} <= jobs  # patches only jobs the runtime has

        installing = client.train(func=_sum_ranks, func_args={"lr": 0.1}, runtime="mlx-distributed", num_nodes=2,
                                  packages_to_install=["mlx-lm==0.1"], run_dir=str(tmp_path / "pkgs"))
        command = server.objects[("trainjobs", "ml", installing)]["spec"]["trainer"]["command"]
        assert command[:2] == ["bash", "-c"] and command[2] == (
            "mpirun --hostfile /etc/mpi/hostfile --map-by ppr:1:node python -m pip install --quiet "
            "--no-warn-script-location --user mlx-lm==0.1 && exec mpirun --hostfile /etc/mpi/hostfile python "
            "/etc/trainjob/train_func.py")


def test_each_runtime_sets_kubeflows_plugin_environment():
    job = "tj"
    assert runtimes.get("jax-distributed").plugin_env(job, 2) == {
        "JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "tj-node-0-0.tj:29500", "JAX_PROCESS_ID": "0"}
    assert runtimes.get("xgboost-distributed").plugin_env(job, 2, gpus_per_node=4) == {
        "DMLC_TRACKER_URI": "tj-node-0-0.tj", "DMLC_TRACKER_PORT": "29500", "DMLC_NUM_WORKER": "8", "DMLC_TASK_ID": "0"}
    assert runtimes.get("mlx-distributed").plugin_env(job, 2) == {
        "OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile", "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
        "OMPI_MCA_orte_set_default_slots": "1", "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}
